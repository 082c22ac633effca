//! timeoutd: a sidecar that fires `TimeOut` messages for a process manager's overdue
//! expectations. See README.md for the contract and the design notes.

pub mod election;
