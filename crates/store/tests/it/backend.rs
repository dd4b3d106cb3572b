//! The stores under test: the conformance tests take a [`Backend`] and run once on SQLite (a
//! database file in a temp dir) and once on PostgreSQL (a database of their own on
//! 127.0.0.1:5432, `nb_test_<random>`, created for the test and dropped after it). `conformance!`
//! generates the two `#[tokio::test]`s of each test body (`on_sqlite::*`, `on_postgres::*`).

use std::sync::Arc;

use nthbouncer_store::postgres::PgStore;
use nthbouncer_store::sqlite::SqliteStore;
use nthbouncer_store::{JobStore, Store};
pub use nthbouncer_testkit::pg::TestDb;

/// Both traits, as one object.
pub trait AnyStore: Store + JobStore {}
impl<T: Store + JobStore> AnyStore for T {}

pub type Db = Arc<dyn AnyStore>;

/// Where a test's data lives; [`Backend::open`] opens (or reopens) a store on it.
pub enum Backend {
    Sqlite(tempfile::TempDir),
    Postgres(TestDb),
}

impl Backend {
    pub fn sqlite() -> Backend {
        Backend::Sqlite(tempfile::tempdir().unwrap())
    }

    pub async fn postgres() -> Backend {
        Backend::Postgres(TestDb::create().await)
    }

    /// A store on this backend's data: a new one each call, as a restart would open it.
    pub async fn open(&self) -> Db {
        match self {
            Backend::Sqlite(dir) => Arc::new(SqliteStore::open_in_dir(dir.path()).unwrap()),
            Backend::Postgres(db) => Arc::new(PgStore::connect(&db.url).await.unwrap()),
        }
    }
}

impl Backend {
    /// Runs `sql` on the backend's database directly, as an earlier version of the store (or an
    /// operator) could have left it: for states the traits no longer write.
    pub async fn execute_raw(&self, sql: &str) {
        match self {
            Backend::Sqlite(dir) => {
                let path = dir.path().join(nthbouncer_store::sqlite::DB_FILE_NAME);
                rusqlite::Connection::open(path)
                    .unwrap()
                    .execute_batch(sql)
                    .unwrap();
            }
            Backend::Postgres(db) => {
                nthbouncer_testkit::pg::admin_client(&db.url)
                    .await
                    .batch_execute(sql)
                    .await
                    .unwrap();
            }
        }
    }
}

/// Generates, for each named test body, one `#[tokio::test]` per implementation.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod on_sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&crate::backend::Backend::sqlite()).await;
                }
            )*
        }
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&crate::backend::Backend::postgres().await).await;
                }
            )*
        }
    };
}
pub(crate) use conformance;
