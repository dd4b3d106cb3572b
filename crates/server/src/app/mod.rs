//! The composition root: the shared state, the API host's router, the listener and the start.
//! The only module that sees every feature; each feature gets the part of the state it needs.

pub mod openapi;
pub mod reload;
pub mod router;
pub mod serve;
pub mod start;
pub mod state;
