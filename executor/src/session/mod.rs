//! The machinery attached to a running group: accepting connections and talking to
//! each rank.

pub(crate) mod accept;
pub(crate) mod link;
pub(crate) mod peer;
pub(crate) mod waiting;
