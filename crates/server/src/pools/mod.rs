//! The pool registry: the live set of pools the hot path reads, and what each pool is made of.

pub mod registry;
