//! A PostgreSQL database of a test's own on the machine's PostgreSQL (127.0.0.1:5432, trust
//! auth, user `postgres` or `root`, or `NTHBOUNCER_TEST_PG_ADMIN_URL`): `nb_test_<pid>_<random>`,
//! created for the test and dropped (connections and all) after it. Used by the store's
//! conformance tests and by the binary's tests on the PostgreSQL store.

use tokio::sync::OnceCell;

static ADMIN_URL: OnceCell<(String, String)> = OnceCell::const_new();

/// `(user, url of the `postgres` database)` for whichever of `postgres` and `root` answers
/// (trust auth), or `NTHBOUNCER_TEST_PG_ADMIN_URL`'s user and URL.
async fn admin() -> &'static (String, String) {
    ADMIN_URL
        .get_or_init(|| async {
            if let Ok(url) = std::env::var("NTHBOUNCER_TEST_PG_ADMIN_URL") {
                let config: tokio_postgres::Config = url.parse().unwrap();
                return (config.get_user().unwrap_or("postgres").to_owned(), url);
            }
            let mut failures = Vec::new();
            for user in ["postgres", "root"] {
                let url = format!("postgres://{user}@127.0.0.1:5432/postgres");
                match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                    Ok(_) => return (user.to_owned(), url),
                    Err(e) => failures.push(format!("{user}: {e}")),
                }
            }
            panic!(
                "PostgreSQL is not answering at 127.0.0.1:5432 (trust auth, user postgres or \
                 root): {}",
                failures.join("; ")
            )
        })
        .await
}

/// A plain connection to `url`, driven on the current runtime.
pub async fn admin_client(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// A database of the test's own, dropped (connections and all) when this is.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub admin_url: String,
}

impl TestDb {
    pub async fn create() -> TestDb {
        let (user, admin_url) = admin().await;
        let name = format!(
            "nb_test_{}_{:012x}",
            std::process::id(),
            rand::random::<u64>() >> 16
        );
        admin_client(admin_url)
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        TestDb {
            url: format!("postgres://{user}@127.0.0.1:5432/{name}"),
            name,
            admin_url: admin_url.clone(),
        }
    }

    /// A plain connection to the test's database (to inspect or tamper with it).
    pub async fn raw(&self) -> tokio_postgres::Client {
        admin_client(&self.url).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (url, name) = (self.admin_url.clone(), self.name.clone());
        // Off the test's runtime (which may be shutting down): a thread with its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                admin_client(&url)
                    .await
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop test database {}", self.name);
        }
    }
}
