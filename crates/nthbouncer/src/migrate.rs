//! `nthbouncer migrate-store --from DATA_DIR --to postgres://…`: moves a node's SQLite store
//! into PostgreSQL (SPEC §12): pools and keys created through the admin API, webhook
//! destinations, and unfinished jobs (requests and all, to run again from the start). Finished
//! jobs, their deliveries and the access log stay behind. A target that already holds any of
//! these is refused unless `--force` (then what exists is kept and the rest added).

use std::path::PathBuf;

use nthbouncer_store::postgres::PgStore;
use nthbouncer_store::sqlite::{SqliteStore, DB_FILE_NAME};
use nthbouncer_store::{JobStore, NewJob, Store, StoreError};

#[derive(clap::Args)]
pub struct MigrateArgs {
    /// The data directory of the node whose SQLite store is moved (holds `nthbouncer.db`).
    #[arg(long)]
    from: PathBuf,
    /// The PostgreSQL database to move it into: `postgres://user[:password]@host/db` or
    /// `env:NAME` (the URL is never printed).
    #[arg(long)]
    to: String,
    /// Add to a target that already holds pools, keys, destinations or unfinished jobs.
    #[arg(long)]
    force: bool,
}

/// What was moved.
#[derive(Default)]
struct Moved {
    pools: usize,
    keys: usize,
    destinations: usize,
    jobs: usize,
    skipped: usize,
}

pub async fn main(args: MigrateArgs) -> Result<(), String> {
    let db = args.from.join(DB_FILE_NAME);
    if !db.is_file() {
        return Err(format!("--from: no SQLite store at {}", db.display()));
    }
    let url = nthbouncer_config::resolve_secret("--to", &args.to).map_err(|e| e.to_string())?;
    let source = SqliteStore::open(&db).map_err(|e| format!("--from: {e}"))?;
    let target = PgStore::connect(&url)
        .await
        .map_err(|e| format!("--to: {e}"))?;
    if !args.force && holds_anything(&target).await.map_err(|e| e.to_string())? {
        return Err(format!(
            "--to: the database {} already holds pools, keys, destinations or jobs; \
             pass --force to add to it",
            target.target()
        ));
    }
    let moved = copy(&source, &target).await.map_err(|e| e.to_string())?;
    println!(
        "moved {} pools, {} keys, {} webhook destinations and {} unfinished jobs to {} \
         ({} already there, kept); finished jobs and the access log stay in {}",
        moved.pools,
        moved.keys,
        moved.destinations,
        moved.jobs,
        target.target(),
        moved.skipped,
        db.display()
    );
    Ok(())
}

async fn holds_anything(target: &PgStore) -> Result<bool, StoreError> {
    Ok(!target.list_pools().await?.is_empty()
        || !target.list_all_keys().await?.is_empty()
        || !target.list_destinations(None).await?.is_empty()
        || !target.unfinished_job_counts().await?.is_empty())
}

/// `Ok(true)` if written, `Ok(false)` if the target had it already.
fn added(r: Result<(), StoreError>) -> Result<bool, StoreError> {
    match r {
        Ok(()) => Ok(true),
        Err(StoreError::Conflict(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

async fn copy(source: &SqliteStore, target: &PgStore) -> Result<Moved, StoreError> {
    let mut moved = Moved::default();
    let count = |done: bool, n: &mut usize, skipped: &mut usize| {
        if done {
            *n += 1
        } else {
            *skipped += 1
        }
    };
    let mut skipped = 0;
    for pool in source.list_pools().await? {
        count(
            added(target.create_pool(&pool).await)?,
            &mut moved.pools,
            &mut skipped,
        );
    }
    for key in source.list_all_keys().await? {
        count(
            added(target.create_key(&key).await)?,
            &mut moved.keys,
            &mut skipped,
        );
    }
    for d in source.list_destinations(None).await? {
        count(
            added(target.create_destination(&d).await)?,
            &mut moved.destinations,
            &mut skipped,
        );
    }
    let existing = target.unfinished_jobs().await?;
    let jobs: Vec<NewJob> = source
        .unfinished_jobs()
        .await?
        .into_iter()
        .filter(|j| {
            let there = existing.iter().any(|e| e.id == j.id);
            skipped += usize::from(there);
            !there
        })
        .map(|j| NewJob {
            id: j.id,
            pool: j.pool,
            reason: j.reason,
            key_id: j.key_id,
            fairness: j.fairness,
            priority: j.priority,
            created_at: j.created_at,
            expires_at: j.expires_at,
            retention_ms: j.retention_ms,
            destinations: j.destinations,
            request: j.request,
            request_id: j.request_id,
        })
        .collect();
    for batch in jobs.chunks(256) {
        target.insert_jobs(batch).await?;
        moved.jobs += batch.len();
    }
    moved.skipped = skipped;
    Ok(moved)
}
