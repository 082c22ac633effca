//! A deterministic simulator of timeoutd's election.
//!
//! It drives the real [`timeoutd::election::Election`] state machines (no copy of the
//! rules) over a simulated topic exchange, in virtual time with a seeded RNG: an hour of
//! a thousand nodes runs in seconds, and the same seed gives the same run. The network
//! delays every delivery (a base plus uniform jitter, so messages reorder), loses and
//! duplicates some; scenarios crash, pause, partition and restart nodes; an attacker
//! may forge and replay announcements, which every node judges with the daemon's own
//! [`timeoutd::admission`]. [`measure`] turns the run into the numbers of the table in
//! docs/design/simulator.md.

pub mod measure;
pub mod net;
pub mod scenario;
pub mod world;

pub use measure::Report;
pub use scenario::{Attack, Scenario, SimConfig, SimRule};
pub use world::run;
