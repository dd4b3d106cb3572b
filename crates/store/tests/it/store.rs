//! Behaviour of the stores through the `Store` trait: the conformance tests run on SQLite (real
//! database files in temporary directories) and on PostgreSQL (a database of each test's own),
//! from the same code (`conformance!`); the SQLite schema's own upgrades are tested here too.
//! Owns nothing but its temp dirs and test databases.

use std::collections::HashSet;
use std::path::Path;

use nthbouncer_store::sqlite::{self, SqliteStore, DB_FILE_NAME, SCHEMA_VERSION};
use nthbouncer_store::{
    AccessLogEntry, AccessLogQuery, LeaseRecord, NonceRecord, Store, StoreError, StoredKey,
    StoredPool,
};
use serde_json::json;

use crate::backend::{conformance, Backend, Db};

conformance!(
    pools_crud_and_conflict,
    delete_pool_takes_its_keys_and_log_only,
    keys_create_list_revoke_and_conflict,
    access_log_batch_and_filters,
    access_log_pagination_with_before_cursor,
    access_log_batch_is_all_or_nothing,
    trim_keeps_the_newest,
    data_survives_reopen,
    concurrent_use_from_many_tasks,
    leases_outstanding_survive_a_reopen_until_released_or_past_their_deadline,
    lease_records_fold_and_stay_exact_over_many_batches,
    nonces_are_remembered_once_and_survive_a_reopen,
    access_log_pages_trim_and_read_across_batches,
    folded_access_log_rows_count_every_bump,
);

fn open(dir: &Path) -> SqliteStore {
    SqliteStore::open_in_dir(dir).unwrap()
}

fn pool(name: &str, now: u64) -> StoredPool {
    StoredPool {
        name: name.to_owned(),
        spec: json!({ "upstream": format!("https://{name}.example"), "limits": { "concurrency": 4 } }),
        created_at: now,
        updated_at: now,
    }
}

fn key(id: &str, pool: &str, created_at: u64) -> StoredKey {
    StoredKey {
        id: id.to_owned(),
        pool: pool.to_owned(),
        hash: format!("hash-of-{id}"),
        label: Some(format!("label {id}")),
        created_at,
        expires_at: None,
        revoked_at: None,
    }
}

fn entry(pool: &str, at: u64, outcome: &str, key_id: Option<&str>) -> AccessLogEntry {
    AccessLogEntry {
        id: 0,
        pool: pool.to_owned(),
        at,
        key_id: key_id.map(str::to_owned),
        client_addr: "10.0.0.1:5555".to_owned(),
        route: "proxy GET /v1/models".to_owned(),
        outcome: outcome.to_owned(),
        reason: (outcome != "admitted").then(|| "queue full".to_owned()),
        status: if outcome == "admitted" { 200 } else { 429 },
        queued_ms: at % 7,
        upstream_status: (outcome == "admitted").then_some(200),
        upstream_latency_ms: (outcome == "admitted").then_some(at % 13),
        count: 1,
        request_id: Some(format!("req-{at}")),
    }
}

fn q(limit: u32) -> AccessLogQuery {
    AccessLogQuery {
        limit,
        ..AccessLogQuery::default()
    }
}

fn ids(entries: &[AccessLogEntry]) -> Vec<u64> {
    entries.iter().map(|e| e.id).collect()
}

#[tokio::test]
async fn open_creates_dirs_file_and_schema() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("nested").join("data");
    let store = sqlite::open_in_dir(&dir).unwrap();
    assert_eq!(store.path(), dir.join(DB_FILE_NAME));
    assert!(dir.join(DB_FILE_NAME).is_file());
    store.ping().await.unwrap();

    let raw = rusqlite::Connection::open(dir.join(DB_FILE_NAME)).unwrap();
    let version: u32 = raw
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let mode: String = raw
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    drop(raw);

    // Opening again (while the first store is still open) is a no-op for the schema.
    let again = sqlite::open(&dir.join(DB_FILE_NAME)).unwrap();
    again.ping().await.unwrap();
}

#[tokio::test]
async fn refuses_a_newer_schema() {
    let tmp = tempfile::tempdir().unwrap();
    drop(open(tmp.path()));
    let raw = rusqlite::Connection::open(tmp.path().join(DB_FILE_NAME)).unwrap();
    raw.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    drop(raw);
    let err = SqliteStore::open_in_dir(tmp.path()).unwrap_err();
    assert!(
        matches!(&err, StoreError::Backend(m) if m.contains("newer")),
        "{err}"
    );
}

async fn pools_crud_and_conflict(b: &Backend) {
    let store = b.open().await;

    assert!(store.list_pools().await.unwrap().is_empty());
    assert_eq!(store.get_pool("b").await.unwrap(), None);

    store.create_pool(&pool("b", 10)).await.unwrap();
    store.create_pool(&pool("a", 20)).await.unwrap();
    let err = store.create_pool(&pool("a", 30)).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Conflict(m) if m.contains('a')),
        "{err}"
    );

    let names: Vec<_> = store
        .list_pools()
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
    // The conflicting create changed nothing.
    assert_eq!(store.get_pool("a").await.unwrap(), Some(pool("a", 20)));

    let spec = json!({ "upstream": "https://new.example", "tags": ["x", "y"], "n": null });
    assert!(store.update_pool("b", &spec, 99).await.unwrap());
    assert!(!store.update_pool("missing", &spec, 99).await.unwrap());
    let b = store.get_pool("b").await.unwrap().unwrap();
    assert_eq!(b.spec, spec);
    assert_eq!((b.created_at, b.updated_at), (10, 99));

    assert!(store.delete_pool("b").await.unwrap());
    assert!(!store.delete_pool("b").await.unwrap());
    assert_eq!(store.get_pool("b").await.unwrap(), None);
    assert_eq!(store.list_pools().await.unwrap().len(), 1);
    // The name is free again.
    store.create_pool(&pool("b", 100)).await.unwrap();
}

async fn delete_pool_takes_its_keys_and_log_only(b: &Backend) {
    let store = b.open().await;
    store.create_pool(&pool("gone", 1)).await.unwrap();
    store.create_pool(&pool("kept", 1)).await.unwrap();
    store.create_key(&key("key_g", "gone", 1)).await.unwrap();
    store.create_key(&key("key_k", "kept", 1)).await.unwrap();
    // A key of a pool that exists only in the config file.
    store.create_key(&key("key_c", "config", 1)).await.unwrap();
    store
        .append_access_log(&[
            entry("gone", 1, "admitted", None),
            entry("kept", 2, "admitted", None),
            entry("config", 3, "admitted", None),
        ])
        .await
        .unwrap();

    assert!(store.delete_pool("gone").await.unwrap());
    assert!(store.list_keys("gone").await.unwrap().is_empty());
    assert!(store
        .query_access_log("gone", &q(10))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(store.list_keys("kept").await.unwrap().len(), 1);
    assert_eq!(
        store.query_access_log("kept", &q(10)).await.unwrap().len(),
        1
    );

    // No pool row for "config": nothing is deleted, its keys and log stay.
    assert!(!store.delete_pool("config").await.unwrap());
    assert_eq!(store.list_keys("config").await.unwrap().len(), 1);
    assert_eq!(
        store
            .query_access_log("config", &q(10))
            .await
            .unwrap()
            .len(),
        1
    );
}

async fn keys_create_list_revoke_and_conflict(b: &Backend) {
    let store = b.open().await;

    // Inserted out of creation order; listing must be oldest first.
    let mut k2 = key("key_2", "p", 200);
    k2.label = None;
    k2.expires_at = Some(5_000);
    store.create_key(&k2).await.unwrap();
    store.create_key(&key("key_1", "p", 100)).await.unwrap();
    store.create_key(&key("key_3", "q", 50)).await.unwrap();

    let listed = store.list_keys("p").await.unwrap();
    assert_eq!(listed, vec![key("key_1", "p", 100), k2.clone()]);
    assert!(store.list_keys("none").await.unwrap().is_empty());

    let all: Vec<_> = store
        .list_all_keys()
        .await
        .unwrap()
        .into_iter()
        .map(|k| k.id)
        .collect();
    assert_eq!(all, ["key_1", "key_2", "key_3"]);

    // Same hash under a new id.
    let mut dup_hash = key("key_9", "q", 1);
    dup_hash.hash = k2.hash.clone();
    let err = store.create_key(&dup_hash).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Conflict(m) if !m.contains(&k2.hash)),
        "{err}"
    );
    // Same id with a new hash.
    let mut dup_id = key("key_1", "q", 1);
    dup_id.hash = "another-hash".to_owned();
    let err = store.create_key(&dup_id).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Conflict(m) if m.contains("key_1")),
        "{err}"
    );
    assert_eq!(store.list_all_keys().await.unwrap().len(), 3);

    assert!(
        !store.revoke_key("q", "key_1", 300).await.unwrap(),
        "wrong pool"
    );
    assert!(
        !store.revoke_key("p", "key_x", 300).await.unwrap(),
        "no such key"
    );
    assert!(store.revoke_key("p", "key_1", 300).await.unwrap());
    assert!(
        !store.revoke_key("p", "key_1", 400).await.unwrap(),
        "already revoked"
    );

    let listed = store.list_keys("p").await.unwrap();
    assert_eq!(
        listed[0].revoked_at,
        Some(300),
        "first revocation time is kept"
    );
    assert_eq!(listed[1].revoked_at, None);
}

async fn access_log_batch_and_filters(b: &Backend) {
    let store = b.open().await;

    // 300 entries in one batch, interleaved with another pool's.
    let batch: Vec<_> = (0..300u64)
        .flat_map(|i| {
            let outcome = if i % 3 == 0 { "429" } else { "admitted" };
            let key_id = (i % 2 == 0).then_some("key_even");
            [
                entry("p", 1_000 + i, outcome, key_id),
                entry("other", 1_000 + i, "admitted", None),
            ]
        })
        .collect();
    store.append_access_log(&batch).await.unwrap();
    store.append_access_log(&[]).await.unwrap();

    let newest = store.query_access_log("p", &q(1000)).await.unwrap();
    assert_eq!(newest.len(), 300);
    assert!(newest.windows(2).all(|w| w[0].id > w[1].id), "newest first");
    assert_eq!(newest[0].at, 1_299);
    assert_eq!(newest[299].at, 1_000);
    // Everything but the id round-trips.
    let mut expected = entry("p", 1_299, "admitted", None);
    expected.id = newest[0].id;
    assert_eq!(newest[0], expected);
    let mut expected = entry("p", 1_000, "429", Some("key_even"));
    expected.id = newest[299].id;
    assert_eq!(newest[299], expected);

    let only = |f: fn(&mut AccessLogQuery)| {
        let mut query = q(1000);
        f(&mut query);
        query
    };

    let rows = store
        .query_access_log("p", &only(|q| q.outcome = Some("429".into())))
        .await
        .unwrap();
    assert_eq!(rows.len(), 100);
    assert!(rows.iter().all(|e| e.outcome == "429"));

    let rows = store
        .query_access_log("p", &only(|q| q.key_id = Some("key_even".into())))
        .await
        .unwrap();
    assert_eq!(rows.len(), 150);
    assert!(rows.iter().all(|e| e.key_id.as_deref() == Some("key_even")));

    let rows = store
        .query_access_log("p", &only(|q| q.since = Some(1_290)))
        .await
        .unwrap();
    assert_eq!(rows.len(), 10, "since is inclusive");
    assert_eq!(rows.last().unwrap().at, 1_290);

    let rows = store
        .query_access_log("p", &only(|q| q.until = Some(1_010)))
        .await
        .unwrap();
    assert_eq!(rows.len(), 10, "until is exclusive");
    assert_eq!(rows[0].at, 1_009);

    let cursor = newest[49].id;
    let rows = store
        .query_access_log(
            "p",
            &AccessLogQuery {
                before: Some(cursor),
                ..q(1000)
            },
        )
        .await
        .unwrap();
    assert_eq!(ids(&rows), ids(&newest[50..]));

    // All filters together.
    let rows = store
        .query_access_log(
            "p",
            &AccessLogQuery {
                before: Some(newest[10].id),
                since: Some(1_100),
                until: Some(1_200),
                outcome: Some("429".into()),
                key_id: Some("key_even".into()),
                limit: 1000,
            },
        )
        .await
        .unwrap();
    let want: Vec<_> = newest
        .iter()
        .filter(|e| e.id < newest[10].id && (1_100..1_200).contains(&e.at))
        .filter(|e| e.outcome == "429" && e.key_id.as_deref() == Some("key_even"))
        .map(|e| e.id)
        .collect();
    assert!(!want.is_empty());
    assert_eq!(ids(&rows), want);

    // Limit is clamped to 1..=1000.
    assert_eq!(store.query_access_log("p", &q(0)).await.unwrap().len(), 1);
    assert_eq!(store.query_access_log("p", &q(7)).await.unwrap().len(), 7);
    assert_eq!(
        store
            .query_access_log("other", &q(u32::MAX))
            .await
            .unwrap()
            .len(),
        300
    );
    store
        .append_access_log(
            &(0..800)
                .map(|i| entry("big", i, "admitted", None))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    store
        .append_access_log(
            &(0..800)
                .map(|i| entry("big", i, "admitted", None))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .query_access_log("big", &q(u32::MAX))
            .await
            .unwrap()
            .len(),
        1000
    );
    assert!(store
        .query_access_log("nobody", &q(10))
        .await
        .unwrap()
        .is_empty());
}

async fn access_log_pagination_with_before_cursor(b: &Backend) {
    let store = b.open().await;
    let batch: Vec<_> = (0..95).map(|i| entry("p", i, "admitted", None)).collect();
    store.append_access_log(&batch).await.unwrap();

    let mut seen = Vec::new();
    let mut before = None;
    loop {
        let page = store
            .query_access_log("p", &AccessLogQuery { before, ..q(20) })
            .await
            .unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 20);
        before = page.last().map(|e| e.id);
        seen.extend(page);
    }
    assert_eq!(seen.len(), 95);
    assert!(seen.windows(2).all(|w| w[0].id > w[1].id));
    let ats: Vec<_> = seen.iter().map(|e| e.at).collect();
    assert_eq!(ats, (0..95).rev().collect::<Vec<_>>());
}

async fn access_log_batch_is_all_or_nothing(b: &Backend) {
    let store = b.open().await;
    let mut batch: Vec<_> = (0..10).map(|i| entry("p", i, "admitted", None)).collect();
    // SQLite integers are signed 64-bit; this row cannot be stored.
    batch[7].at = u64::MAX;
    let err = store.append_access_log(&batch).await.unwrap_err();
    assert!(matches!(err, StoreError::Backend(_)), "{err}");
    assert!(store
        .query_access_log("p", &q(100))
        .await
        .unwrap()
        .is_empty());
}

async fn trim_keeps_the_newest(b: &Backend) {
    let store = b.open().await;
    let batch: Vec<_> = (0..50)
        .flat_map(|i| {
            [
                entry("p", i, "admitted", None),
                entry("o", i, "admitted", None),
            ]
        })
        .collect();
    store.append_access_log(&batch).await.unwrap();
    let before = store.query_access_log("p", &q(1000)).await.unwrap();

    assert_eq!(store.trim_access_log("p", 100).await.unwrap(), 0);
    assert_eq!(store.trim_access_log("p", 50).await.unwrap(), 0);
    assert_eq!(store.trim_access_log("p", 20).await.unwrap(), 30);
    let after = store.query_access_log("p", &q(1000)).await.unwrap();
    assert_eq!(ids(&after), ids(&before[..20]));
    assert_eq!(store.trim_access_log("p", 20).await.unwrap(), 0);
    assert_eq!(store.trim_access_log("p", u64::MAX).await.unwrap(), 0);

    // Other pools are untouched.
    assert_eq!(
        store.query_access_log("o", &q(1000)).await.unwrap().len(),
        50
    );

    assert_eq!(store.trim_access_log("p", 0).await.unwrap(), 20);
    assert!(store
        .query_access_log("p", &q(1000))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(store.trim_access_log("nobody", 0).await.unwrap(), 0);
}

async fn data_survives_reopen(b: &Backend) {
    let last_id;
    {
        let store = b.open().await;
        store.create_pool(&pool("p", 1)).await.unwrap();
        store.create_key(&key("key_1", "p", 2)).await.unwrap();
        store.revoke_key("p", "key_1", 3).await.unwrap();
        let batch: Vec<_> = (0..10).map(|i| entry("p", i, "admitted", None)).collect();
        store.append_access_log(&batch).await.unwrap();
        last_id = store.query_access_log("p", &q(1)).await.unwrap()[0].id;
        // Removing the newest rows must not let their ids be handed out again.
        store.trim_access_log("p", 0).await.unwrap();
        store
            .append_access_log(&[entry("p", 10, "admitted", None)])
            .await
            .unwrap();
    }

    let store = b.open().await;
    assert_eq!(store.get_pool("p").await.unwrap(), Some(pool("p", 1)));
    let keys = store.list_all_keys().await.unwrap();
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].revoked_at, Some(3));
    let log = store.query_access_log("p", &q(100)).await.unwrap();
    assert_eq!(log.len(), 1);
    assert!(log[0].id > last_id);

    store.trim_access_log("p", 0).await.unwrap();
    store
        .append_access_log(&[entry("p", 11, "admitted", None)])
        .await
        .unwrap();
    let log = store.query_access_log("p", &q(100)).await.unwrap();
    assert!(log[0].id > last_id + 1, "ids stay monotonic across reopen");
}

async fn concurrent_use_from_many_tasks(b: &Backend) {
    let store = b.open().await;
    store.create_pool(&pool("p", 0)).await.unwrap();

    const TASKS: u64 = 32;
    const ROUNDS: u64 = 10;
    let mut handles = Vec::new();
    for t in 0..TASKS {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            for r in 0..ROUNDS {
                let id = format!("key_{t}_{r}");
                store.create_key(&key(&id, "p", t * 100 + r)).await?;
                let batch: Vec<_> = (0..5)
                    .map(|i| entry("p", t * 1000 + r * 10 + i, "admitted", Some(&id)))
                    .collect();
                store.append_access_log(&batch).await?;
                store.query_access_log("p", &q(50)).await?;
                store.list_keys("p").await?;
                store.get_pool("p").await?;
                store.ping().await?;
                if r % 4 == 0 {
                    store.trim_access_log("other", 10).await?;
                    store
                        .update_pool("p", &json!({ "writer": t }), t * 100 + r)
                        .await?;
                }
            }
            Ok::<_, StoreError>(())
        }));
    }
    for h in handles {
        h.await.unwrap().unwrap();
    }

    assert_eq!(
        store.list_keys("p").await.unwrap().len() as u64,
        TASKS * ROUNDS
    );
    // More rows than one page holds: walk them with the cursor.
    let mut log = Vec::new();
    let mut before = None;
    loop {
        let page = store
            .query_access_log("p", &AccessLogQuery { before, ..q(1000) })
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        before = Some(last.id);
        log.extend(page);
    }
    assert_eq!(log.len() as u64, TASKS * ROUNDS * 5);
    let unique: HashSet<_> = log.iter().map(|e| e.id).collect();
    assert_eq!(unique.len(), log.len());
}

fn lease(id: &str, pool: &str, request_deadline: u64) -> LeaseRecord {
    LeaseRecord {
        slot_id: id.to_owned(),
        pool: pool.to_owned(),
        request_deadline,
    }
}

async fn leases_outstanding_survive_a_reopen_until_released_or_past_their_deadline(b: &Backend) {
    {
        let store = b.open().await;
        let granted = [
            lease("a", "p", 5_000),
            lease("b", "p", 9_000),
            lease("c", "q", 2_000),
        ];
        store.apply_leases(&granted, &[], 1_000).await.unwrap();
        store.apply_leases(&[], &["b".into()], 1_000).await.unwrap();
    }
    let store = b.open().await;
    assert_eq!(
        store.outstanding_leases(1_000).await.unwrap(),
        vec![lease("a", "p", 5_000), lease("c", "q", 2_000)]
    );
    // Past its request deadline a lease cannot be held any more: it is not reported, and the
    // next write forgets it.
    assert_eq!(
        store.outstanding_leases(2_000).await.unwrap(),
        vec![lease("a", "p", 5_000)]
    );
    store.apply_leases(&[], &[], 5_000).await.unwrap();
    assert_eq!(store.outstanding_leases(0).await.unwrap(), vec![]);
}

/// Thousands of grant and release batches (on SQLite the journal folds itself many times over):
/// what is outstanding is exactly what was granted and neither released, re-granted away nor
/// due, and SQLite's journal stays short.
async fn lease_records_fold_and_stay_exact_over_many_batches(b: &Backend) {
    let store = b.open().await;
    let mut expect = std::collections::BTreeMap::new();
    for i in 0..2_000u64 {
        let now = 1_000 + i;
        // Every slot is granted; most are released a few batches later; every 7th is kept
        // with a long deadline, every 11th has one already past by the end.
        let id = format!("s{i:05}");
        let deadline = if i % 11 == 0 {
            now + 50
        } else {
            now + 1_000_000
        };
        let released: Vec<String> = if i >= 3 && (i - 3) % 7 != 0 {
            vec![format!("s{:05}", i - 3)]
        } else {
            vec![]
        };
        store
            .apply_leases(&[lease(&id, "p", deadline)], &released, now)
            .await
            .unwrap();
        expect.insert(id, deadline);
        for r in &released {
            expect.remove(r);
        }
    }
    let now = 3_000;
    let want: Vec<_> = expect
        .into_iter()
        .filter(|(_, d)| *d > now)
        .map(|(id, d)| lease(&id, "p", d))
        .collect();
    assert!(want.len() > 250, "{}", want.len());
    drop(store);
    let store = b.open().await;
    assert_eq!(store.outstanding_leases(now).await.unwrap(), want);
    if let Backend::Sqlite(dir) = b {
        let raw = rusqlite::Connection::open(dir.path().join(DB_FILE_NAME)).unwrap();
        let rows: i64 = raw
            .query_row("SELECT COUNT(*) FROM lease_journal", [], |r| r.get(0))
            .unwrap();
        assert!(rows <= 256, "the journal folds: {rows} rows");
    }
}

/// A store written by schema v9 (leases as a table) keeps its outstanding leases on open.
#[tokio::test]
async fn a_v9_store_moves_its_leases_into_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path()));
    let raw = rusqlite::Connection::open(dir.path().join(DB_FILE_NAME)).unwrap();
    raw.execute_batch(
        "DROP TABLE lease_journal;
         CREATE TABLE leases (slot_id TEXT PRIMARY KEY, pool TEXT NOT NULL,
             request_deadline INTEGER NOT NULL) WITHOUT ROWID;
         INSERT INTO leases VALUES ('a', 'p', 5000), ('b', 'q', 9000), ('c', 'p', 100);
         PRAGMA user_version = 9;",
    )
    .unwrap();
    drop(raw);
    let store = open(dir.path());
    assert_eq!(
        store.outstanding_leases(1_000).await.unwrap(),
        vec![lease("a", "p", 5_000), lease("b", "q", 9_000)]
    );
    store.apply_leases(&[], &["a".into()], 1_000).await.unwrap();
    assert_eq!(
        store.outstanding_leases(1_000).await.unwrap(),
        vec![lease("b", "q", 9_000)]
    );
}

fn nonce(pool: &str, digest: u8, expires_at: u64) -> NonceRecord {
    NonceRecord {
        pool: pool.to_owned(),
        digest: vec![digest; 16],
        expires_at,
    }
}

/// Seen HMAC nonces are durable (SPEC §9): before, they lived only in the process and a restart
/// reopened the replay window (the store had no nonce methods at all).
async fn nonces_are_remembered_once_and_survive_a_reopen(b: &Backend) {
    {
        let store = b.open().await;
        let fresh = store
            .remember_nonces(
                &[
                    nonce("p", 1, 10_000),
                    nonce("p", 2, 10_000),
                    // The same digest on another pool is another nonce.
                    nonce("q", 1, 10_000),
                    // Twice in one batch: the second is a replay of the first.
                    nonce("p", 3, 10_000),
                    nonce("p", 3, 10_000),
                ],
                1_000,
            )
            .await
            .unwrap();
        assert_eq!(fresh, vec![true, true, true, true, false]);
        // A replay is refused and leaves the record as it was (no extension).
        assert_eq!(
            store
                .remember_nonces(&[nonce("p", 1, 99_000), nonce("p", 4, 12_000)], 2_000)
                .await
                .unwrap(),
            vec![false, true]
        );
    }
    // Reopened, as after a restart: everything unexpired is still there.
    let store = b.open().await;
    let mut loaded = store.unexpired_nonces(2_000).await.unwrap();
    loaded.sort_by(|a, b| (&a.pool, &a.digest).cmp(&(&b.pool, &b.digest)));
    assert_eq!(
        loaded,
        vec![
            nonce("p", 1, 10_000),
            nonce("p", 2, 10_000),
            nonce("p", 3, 10_000),
            nonce("p", 4, 12_000),
            nonce("q", 1, 10_000),
        ]
    );
    assert_eq!(
        store
            .remember_nonces(&[nonce("p", 2, 20_000)], 3_000)
            .await
            .unwrap(),
        vec![false]
    );
    // Expired at `now` (expires_at <= now): not loaded, new again, and purged.
    assert_eq!(
        store.unexpired_nonces(10_000).await.unwrap(),
        vec![nonce("p", 4, 12_000)]
    );
    assert_eq!(
        store
            .remember_nonces(&[nonce("p", 1, 30_000)], 10_000)
            .await
            .unwrap(),
        vec![true]
    );
    assert_eq!(store.purge_nonces(10_000).await.unwrap(), 3);
    let left = store.unexpired_nonces(0).await.unwrap();
    assert_eq!(left, vec![nonce("p", 4, 12_000), nonce("p", 1, 30_000)]);
    assert_eq!(
        store.remember_nonces(&[], 0).await.unwrap(),
        Vec::<bool>::new()
    );
}

/// A store written by the previous schema (v4, no nonce table) migrates on open and keeps its
/// data.
#[tokio::test]
async fn a_v4_store_migrates_to_remember_nonces() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let store = open(tmp.path());
        store.create_pool(&pool("p", 1)).await.unwrap();
    }
    let raw = rusqlite::Connection::open(tmp.path().join(DB_FILE_NAME)).unwrap();
    raw.execute_batch("DROP TABLE nonces; PRAGMA user_version = 4;")
        .unwrap();
    drop(raw);
    let store = open(tmp.path());
    assert!(store.get_pool("p").await.unwrap().is_some());
    assert_eq!(
        store
            .remember_nonces(&[nonce("p", 1, 5_000)], 0)
            .await
            .unwrap(),
        vec![true]
    );
}

/// The access log as schema v8 and earlier kept it: one row per request. `columns` beyond
/// v1's are added as the later schemas did.
fn old_access_log(raw: &rusqlite::Connection, count: bool, request_id: bool) {
    raw.execute_batch(
        "CREATE TABLE access_log (
            id                  INTEGER PRIMARY KEY AUTOINCREMENT,
            pool                TEXT NOT NULL,
            at                  INTEGER NOT NULL,
            key_id              TEXT,
            client_addr         TEXT NOT NULL,
            route               TEXT NOT NULL,
            outcome             TEXT NOT NULL,
            reason              TEXT,
            status              INTEGER NOT NULL,
            queued_ms           INTEGER NOT NULL,
            upstream_status     INTEGER,
            upstream_latency_ms INTEGER
        );
        CREATE INDEX access_log_pool_id ON access_log (pool, id);
        DROP TABLE access_log_pages; DROP TABLE access_log_counts; DROP TABLE store_meta;",
    )
    .unwrap();
    if count {
        raw.execute_batch("ALTER TABLE access_log ADD COLUMN count INTEGER NOT NULL DEFAULT 1;")
            .unwrap();
    }
    if request_id {
        raw.execute_batch("ALTER TABLE access_log ADD COLUMN request_id TEXT;")
            .unwrap();
    }
}

fn old_row(raw: &rusqlite::Connection, pool: &str, at: u64, outcome: &str, key: Option<&str>) {
    raw.execute(
        "INSERT INTO access_log (pool, at, key_id, client_addr, route, outcome, status, queued_ms) \
         VALUES (?1, ?2, ?3, '127.0.0.1', 'proxy GET /', ?4, 200, 0)",
        rusqlite::params![pool, at as i64, key, outcome],
    )
    .unwrap();
}

/// A store written by schema v6 (one row per request, no `count`) migrates on open: its rows
/// stand for one request each, and new rows can be folded.
#[tokio::test]
async fn a_v6_store_migrates_to_counted_access_log_rows() {
    let tmp = tempfile::tempdir().unwrap();
    drop(open(tmp.path()));
    let raw = rusqlite::Connection::open(tmp.path().join(DB_FILE_NAME)).unwrap();
    old_access_log(&raw, false, false);
    old_row(&raw, "p", 1, "401", None);
    old_row(&raw, "p", 2, "admitted", Some("k"));
    raw.execute_batch("PRAGMA user_version = 6;").unwrap();
    drop(raw);
    let store = open(tmp.path());
    let rows = store.query_access_log("p", &q(10)).await.unwrap();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.count == 1), "{rows:?}");

    // Folded: a new row standing for three, and two more requests added to an old one.
    let mut folded = entry("p", 3, "401", None);
    folded.count = 3;
    let old = rows[1].id;
    let ids = store
        .append_access_log_folded(vec![folded], vec![(old, 2), (9_999, 5)])
        .await
        .unwrap();
    assert_eq!(ids.len(), 1);
    let rows = store.query_access_log("p", &q(10)).await.unwrap();
    let count_of = |id: u64| rows.iter().find(|r| r.id == id).unwrap().count;
    assert_eq!(count_of(ids[0]), 3);
    assert_eq!(count_of(old), 3, "1 + 2");
    assert_eq!(rows.iter().map(|r| r.count).sum::<u64>(), 7);
}

/// A store written by schema v8 (one row per request) moves its rows into pages on open:
/// every column, id and count kept, and no id handed out again, not even those of rows
/// deleted before the move.
#[tokio::test]
async fn a_v8_store_moves_its_access_log_into_pages() {
    let tmp = tempfile::tempdir().unwrap();
    drop(open(tmp.path()));
    let raw = rusqlite::Connection::open(tmp.path().join(DB_FILE_NAME)).unwrap();
    old_access_log(&raw, true, true);
    for i in 0..1_100u64 {
        old_row(
            &raw,
            if i % 2 == 0 { "p" } else { "o" },
            i,
            "admitted",
            Some("k"),
        );
    }
    raw.execute_batch(
        "UPDATE access_log SET count = 4, request_id = 'req-x', reason = 'why', \
             upstream_status = 201, upstream_latency_ms = 7 WHERE id = 3;
         INSERT INTO access_log (pool, at, client_addr, route, outcome, status, queued_ms) \
             VALUES ('p', 5000, 'a', 'r', 'admitted', 200, 0);
         DELETE FROM access_log WHERE at = 5000;
         PRAGMA user_version = 8;",
    )
    .unwrap();
    drop(raw);

    let store = open(tmp.path());
    let mut p = Vec::new();
    let mut before = None;
    loop {
        let page = store
            .query_access_log("p", &AccessLogQuery { before, ..q(1000) })
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        before = Some(last.id);
        p.extend(page);
    }
    assert_eq!(p.len(), 550);
    assert!(p.windows(2).all(|w| w[0].id > w[1].id), "newest first");
    assert_eq!(p.last().unwrap().id, 1);
    let third = p.iter().find(|e| e.id == 3).unwrap();
    assert_eq!(
        (
            third.count,
            third.request_id.as_deref(),
            third.reason.as_deref()
        ),
        (4, Some("req-x"), Some("why"))
    );
    assert_eq!(
        (third.upstream_status, third.upstream_latency_ms, third.at),
        (Some(201), Some(7), 2)
    );
    assert_eq!(
        store.query_access_log("o", &q(1000)).await.unwrap().len(),
        550
    );
    let raw = rusqlite::Connection::open(tmp.path().join(DB_FILE_NAME)).unwrap();
    let old_table: i64 = raw
        .query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE name = 'access_log'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(old_table, 0, "the old table is gone");

    store
        .append_access_log(&[entry("p", 6000, "admitted", None)])
        .await
        .unwrap();
    let newest = store.query_access_log("p", &q(1)).await.unwrap();
    assert_eq!(newest[0].id, 1_102, "past the deleted row's id 1101");
}

/// A store written by the previous schema (v7, no request ids) migrates on open (#13): old
/// rows and jobs have no request id, new ones keep theirs.
#[tokio::test]
async fn a_v7_store_migrates_to_request_ids() {
    let tmp = tempfile::tempdir().unwrap();
    drop(open(tmp.path()));
    let raw = rusqlite::Connection::open(tmp.path().join(DB_FILE_NAME)).unwrap();
    old_access_log(&raw, true, false);
    old_row(&raw, "p", 1, "admitted", Some("k"));
    raw.execute_batch(
        "ALTER TABLE jobs DROP COLUMN request_id;
         ALTER TABLE deliveries DROP COLUMN request_id; PRAGMA user_version = 7;",
    )
    .unwrap();
    drop(raw);
    let store = open(tmp.path());
    let raw = rusqlite::Connection::open(tmp.path().join(DB_FILE_NAME)).unwrap();
    let version: u32 = raw
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    store
        .append_access_log(&[entry("p", 2, "admitted", Some("k"))])
        .await
        .unwrap();
    let rows = store.query_access_log("p", &q(10)).await.unwrap();
    let ids: Vec<_> = rows.iter().map(|r| r.request_id.as_deref()).collect();
    assert_eq!(ids, vec![Some("req-2"), None], "newest first");
}

/// Entries span many pages (batches of several sizes, one larger than a page): reads page
/// through them newest first, and a trim keeps exactly the newest, wherever the boundary falls.
async fn access_log_pages_trim_and_read_across_batches(b: &Backend) {
    let store = b.open().await;
    let mut at = 0;
    for size in [1usize, 700, 3, 1200, 50] {
        let batch: Vec<_> = (0..size)
            .map(|_| {
                at += 1;
                let outcome = if at % 7 == 0 { "429" } else { "admitted" };
                entry("p", at, outcome, None)
            })
            .collect();
        store.append_access_log(&batch).await.unwrap();
    }
    let total = 1 + 700 + 3 + 1200 + 50;
    let all = |store: Db| async move {
        let mut seen = Vec::new();
        let mut before = None;
        loop {
            let page = store
                .query_access_log("p", &AccessLogQuery { before, ..q(333) })
                .await
                .unwrap();
            let Some(last) = page.last() else { break };
            before = Some(last.id);
            seen.extend(page);
        }
        seen
    };
    let seen = all(store.clone()).await;
    assert_eq!(seen.len(), total);
    let ats: Vec<u64> = seen.iter().map(|e| e.at).collect();
    assert_eq!(ats, (1..=total as u64).rev().collect::<Vec<_>>());
    let refused = store
        .query_access_log(
            "p",
            &AccessLogQuery {
                outcome: Some("429".into()),
                since: Some(100),
                until: Some(1_000),
                ..q(1000)
            },
        )
        .await
        .unwrap();
    let expect: Vec<u64> = (100..1_000).rev().filter(|a| a % 7 == 0).collect();
    assert_eq!(refused.iter().map(|e| e.at).collect::<Vec<_>>(), expect);

    for keep in [1_500u64, 1_253, 1_250, 600, 1] {
        let before = all(store.clone()).await.len() as u64;
        let removed = store.trim_access_log("p", keep).await.unwrap();
        assert_eq!(removed, before.saturating_sub(keep), "keep {keep}");
        let after = all(store.clone()).await;
        assert_eq!(after.len() as u64, keep.min(before));
        let ats: Vec<u64> = after.iter().map(|e| e.at).collect();
        let newest = total as u64;
        assert_eq!(
            ats,
            (newest + 1 - ats.len() as u64..=newest)
                .rev()
                .collect::<Vec<_>>()
        );
    }
}

/// A batch's new rows get increasing ids in their order, and its bumps add to older rows'
/// counts: a row bumped twice in one batch gets both, an unknown id is ignored.
async fn folded_access_log_rows_count_every_bump(b: &Backend) {
    let store = b.open().await;
    let first = store
        .append_access_log_folded(vec![entry("p", 1, "401", None)], vec![])
        .await
        .unwrap();
    let mut folded = entry("p", 2, "401", None);
    folded.count = 4;
    let ids = store
        .append_access_log_folded(
            vec![folded, entry("p", 3, "admitted", Some("k"))],
            vec![(first[0], 2), (9_999, 5), (first[0], 3)],
        )
        .await
        .unwrap();
    assert_eq!(ids.len(), 2);
    assert!(first[0] < ids[0] && ids[0] < ids[1], "{first:?} {ids:?}");
    let rows = store.query_access_log("p", &q(10)).await.unwrap();
    let count_of = |id: u64| rows.iter().find(|r| r.id == id).unwrap().count;
    assert_eq!(
        (count_of(first[0]), count_of(ids[0]), count_of(ids[1])),
        (6, 4, 1)
    );
    let bumps_only = store
        .append_access_log_folded(vec![], vec![(ids[1], 1)])
        .await
        .unwrap();
    assert!(bumps_only.is_empty());
    let rows = store.query_access_log("p", &q(10)).await.unwrap();
    assert_eq!(rows.iter().map(|r| r.count).sum::<u64>(), 12);
}
