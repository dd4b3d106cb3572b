//! Everything about calling an origin that the proxy and the job runner share.

pub mod outcome;
