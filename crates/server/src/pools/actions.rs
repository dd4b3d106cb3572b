//! The changes to a pool's runtime state that the admin API and the dashboard both make, with
//! their validation: create a key, add, change and rotate a webhook destination, redeliver a
//! job. One place, so the two clients refuse the same input with the same `400 invalid` (and
//! field), and neither feature imports the other.

use nthbouncer_config::keys;
use nthbouncer_store::{Redeliver, StoredDestination, StoredKey};

use super::registry::PoolRuntime;
use super::Pools;
use crate::core::error::{ApiError, ErrorCode};
use crate::core::extract::epoch_ms;

/// The longest key label.
pub const MAX_LABEL_LEN: usize = 200;
/// Longest grace a rotated secret may keep signing.
pub const MAX_ROTATION_GRACE_S: u64 = 604_800;
pub const DEFAULT_ROTATION_GRACE_S: u64 = 86_400;
/// Consecutive failures that deactivate a destination, unless it says otherwise.
pub const DEFAULT_DEACTIVATE_AFTER: u32 = 20;

/// A key just made: its record and its plaintext, shown this once.
pub struct MadeKey {
    pub stored: StoredKey,
    pub key: String,
}

/// What a destination change asks for (absent: unchanged).
#[derive(Default)]
pub struct DestinationChange {
    pub active: Option<bool>,
    pub url: Option<String>,
    pub deactivate_after: Option<u32>,
}

/// A rotated secret: the new one (shown this once) and until when the previous one signs.
pub struct Rotated {
    pub secret: String,
    pub previous_secret_expires_at: Option<u64>,
}

pub fn job_not_found() -> ApiError {
    ApiError::new(ErrorCode::JobNotFound, "no such job in this pool")
}

pub fn valid_job_id(id: &str) -> bool {
    id.strip_prefix("job_")
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

pub fn destination_not_found() -> ApiError {
    ApiError::new(
        ErrorCode::DestinationNotFound,
        "no such webhook destination in this pool",
    )
}

/// The destination `id` of `pool`, or `404 destination_not_found`.
pub fn find_destination(pool: &PoolRuntime, id: &str) -> Result<StoredDestination, ApiError> {
    pool.destinations
        .load()
        .iter()
        .find(|d| d.id == id)
        .cloned()
        .ok_or_else(destination_not_found)
}

/// Refuses to change a destination the config file or the pool's settings declare.
pub fn only_api_managed(pool: &str, d: &StoredDestination) -> Result<(), ApiError> {
    if d.managed_by != "api" {
        return Err(super::owned_elsewhere(pool, &d.managed_by));
    }
    Ok(())
}

fn check_deactivate_after(n: u32) -> Result<u32, ApiError> {
    if n == 0 {
        return Err(ApiError::invalid(
            "deactivateAfter",
            "deactivateAfter must be at least 1",
        ));
    }
    Ok(n)
}

impl Pools {
    /// Makes a key of pool `name` (label at most [`MAX_LABEL_LEN`] characters, an expiry in the
    /// future), stores it and puts it in the pool's index.
    pub async fn create_key(
        &self,
        name: &str,
        label: Option<String>,
        expires_at: Option<u64>,
    ) -> Result<MadeKey, ApiError> {
        let pool = self.get_or_404(name)?;
        if label
            .as_ref()
            .is_some_and(|l| l.chars().count() > MAX_LABEL_LEN)
        {
            return Err(ApiError::invalid(
                "label",
                format!("label must be at most {MAX_LABEL_LEN} characters"),
            ));
        }
        let now = self.now();
        epoch_ms("expiresAt", expires_at)?;
        if expires_at.is_some_and(|at| at <= now) {
            return Err(ApiError::invalid(
                "expiresAt",
                "expiresAt must be in the future (epoch milliseconds)",
            ));
        }
        let key = keys::generate_key();
        let digest = keys::digest(&key);
        let stored = StoredKey {
            id: keys::key_id_from_digest(&digest),
            pool: pool.name.clone(),
            hash: hex::encode(digest),
            label,
            created_at: now,
            expires_at,
            revoked_at: None,
        };
        self.add_key(&pool.name, &stored).await?;
        Ok(MadeKey { stored, key })
    }

    /// Adds a destination to pool `name` (a URL the address guard allows, a `whsec_` secret or
    /// a generated one, room under `server.max_destinations_per_pool`).
    pub async fn create_destination(
        &self,
        name: &str,
        url: String,
        secret: Option<String>,
        deactivate_after: Option<u32>,
    ) -> Result<StoredDestination, ApiError> {
        let pool = self.get_or_404(name)?;
        let allow_private = self.live.load().allow_private_webhooks;
        crate::core::netcheck::check_webhook_url("url", &url, allow_private).await?;
        let secret = match secret {
            Some(s) => {
                nthbouncer_config::async_jobs::check_webhook_secret("secret", &s)
                    .map_err(|e| ApiError::invalid("secret", e.rule))?;
                s
            }
            None => keys::generate_webhook_secret(),
        };
        let deactivate_after =
            check_deactivate_after(deactivate_after.unwrap_or(DEFAULT_DEACTIVATE_AFTER))?;
        let _guard = self.lock_changes().await;
        let count = pool.destinations.load().len();
        let cap = self.live.load().max_destinations_per_pool as usize;
        if count >= cap {
            return Err(ApiError::new(
                ErrorCode::TooManyDestinations,
                format!("pool {name:?} already has {count} destinations (server.max_destinations_per_pool = {cap})"),
            ));
        }
        let d = StoredDestination {
            id: format!("wh_{:024x}", rand::random::<u128>() >> 32),
            pool: pool.name.clone(),
            url,
            secret,
            active: true,
            deactivate_after,
            consecutive_failures: 0,
            deactivated_at: None,
            managed_by: "api".into(),
            created_at: self.now(),
            previous_secret: None,
            previous_secret_expires_at: None,
        };
        self.jobs.create_destination(&d).await?;
        self.refresh_destinations(&pool).await?;
        Ok(d)
    }

    /// Changes destination `id` of pool `name`: re-enabling clears its failure streak; its URL
    /// and threshold change only on a destination added through the API.
    pub async fn change_destination(
        &self,
        name: &str,
        id: &str,
        change: DestinationChange,
    ) -> Result<StoredDestination, ApiError> {
        let pool = self.get_or_404(name)?;
        let _guard = self.lock_changes().await;
        let mut d = find_destination(&pool, id)?;
        if d.managed_by != "api" && (change.url.is_some() || change.deactivate_after.is_some()) {
            return Err(super::owned_elsewhere(name, &d.managed_by));
        }
        if let Some(url) = change.url {
            let allow_private = self.live.load().allow_private_webhooks;
            crate::core::netcheck::check_webhook_url("url", &url, allow_private).await?;
            d.url = url;
        }
        if let Some(n) = change.deactivate_after {
            d.deactivate_after = check_deactivate_after(n)?;
        }
        if let Some(active) = change.active {
            d.active = active;
            if active {
                d.consecutive_failures = 0;
                d.deactivated_at = None;
            } else if d.deactivated_at.is_none() {
                d.deactivated_at = Some(self.now());
            }
        }
        if !self.jobs.update_destination(&d).await? {
            return Err(destination_not_found());
        }
        self.refresh_destinations(&pool).await?;
        Ok(d)
    }

    /// Deletes destination `id` of pool `name` (one added through the API).
    pub async fn delete_destination(&self, name: &str, id: &str) -> Result<(), ApiError> {
        let pool = self.get_or_404(name)?;
        let _guard = self.lock_changes().await;
        let d = find_destination(&pool, id)?;
        only_api_managed(name, &d)?;
        self.jobs.delete_destination(&pool.name, id).await?;
        self.refresh_destinations(&pool).await
    }

    /// Gives destination `id` of pool `name` a new secret; the previous one keeps signing beside
    /// it for `grace_s` seconds (0..=[`MAX_ROTATION_GRACE_S`], default a day).
    pub async fn rotate_destination_secret(
        &self,
        name: &str,
        id: &str,
        grace_s: Option<u64>,
    ) -> Result<Rotated, ApiError> {
        let pool = self.get_or_404(name)?;
        let grace_s = grace_s.unwrap_or(DEFAULT_ROTATION_GRACE_S);
        if grace_s > MAX_ROTATION_GRACE_S {
            return Err(ApiError::invalid(
                "graceS",
                format!("graceS must be between 0 and {MAX_ROTATION_GRACE_S}"),
            ));
        }
        let _guard = self.lock_changes().await;
        let d = find_destination(&pool, id)?;
        only_api_managed(name, &d)?;
        let secret = keys::generate_webhook_secret();
        let until = (grace_s > 0).then(|| self.now().saturating_add(grace_s * 1000));
        if !self
            .jobs
            .rotate_destination_secret(&pool.name, id, &secret, until)
            .await?
        {
            return Err(destination_not_found());
        }
        self.refresh_destinations(&pool).await?;
        Ok(Rotated {
            secret,
            previous_secret_expires_at: until,
        })
    }

    /// Queues a new delivery round of pool `name`'s terminal job `job_id` to each of its active
    /// destinations; how many.
    pub async fn redeliver(&self, name: &str, job_id: &str) -> Result<u32, ApiError> {
        let pool = self.get_or_404(name)?;
        if !valid_job_id(job_id) {
            return Err(job_not_found());
        }
        let destinations = pool.active_destination_ids();
        if destinations.is_empty() {
            return Err(ApiError::new(
                ErrorCode::NoActiveDestination,
                "the pool has no active webhook destination to deliver to",
            ));
        }
        match self
            .jobs
            .redeliver_job(&pool.name, job_id, &destinations, self.now())
            .await?
        {
            Redeliver::NoSuchJob => Err(job_not_found()),
            Redeliver::NotTerminal => Err(ApiError::new(
                ErrorCode::JobNotTerminal,
                "the job has not ended yet; it is delivered when it does",
            )),
            Redeliver::Queued(n) => {
                // The dispatcher's wake-up (`AppState::deliveries_pending`).
                self.destinations_changed.notify_one();
                Ok(n)
            }
        }
    }
}
