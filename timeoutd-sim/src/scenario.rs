//! What a run is: the group, the network, the rule, and the disruptions.

use std::time::Duration;

use timeoutd::election::Rule;

use crate::net::Links;

/// Which announce rule the (new) nodes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SimRule {
    /// Every node announces every interval (earlier versions; config `all`).
    #[value(alias = "all")]
    Old,
    /// Only the `announcers` lowest candidates announce (config `lowest`).
    #[value(alias = "lowest")]
    New,
}

/// What an attacker on the announcement exchange does, every 100 ms of the run. Members
/// judge what they receive as the daemon does (`timeoutd::admission`), so a run under
/// attack must measure exactly as the same run without one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Attack {
    #[default]
    None,
    /// Announcements without proof of membership: the lowest id there is (as active),
    /// without a user or as another broker user; a `leaving` for the active node; with
    /// a group secret, the same signed with a made-up signature.
    Forge,
    /// Copies of real announcements (proof and all) captured at least two `member_ttl`
    /// and an `announce_interval` (7 s) earlier, sent again: old `leaving`s, dead
    /// nodes, each node's own.
    Replay,
    /// Both.
    ForgeAndReplay,
}

impl Attack {
    pub fn forges(self) -> bool {
        matches!(self, Attack::Forge | Attack::ForgeAndReplay)
    }

    pub fn replays(self) -> bool {
        matches!(self, Attack::Replay | Attack::ForgeAndReplay)
    }
}

/// The disruptions of a run, repeated every `period` after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Nothing but the network's own loss and jitter.
    None,
    /// Same as `none`; named for table rows that differ only in `--loss`/`--jitter`.
    Loss,
    /// One node after the other leaves gracefully and starts again (a fresh id) 1 s
    /// later, every 2 s; old-rule nodes come back with `--rule` (a rolling deploy).
    RollingRestart,
    /// Every 20 s the active node is cut off from the broker for 5 s (it hears nothing,
    /// its announcements go nowhere), then heals.
    PartitionLowest,
    /// Every 10 s the active node crashes (no `leaving`); a fresh node replaces it 2 s
    /// later.
    CrashLowest,
    /// Every 20 s the active node is paused for 5 s (stops ticking and receiving; its
    /// queue fills), then resumes with its stale view.
    PauseLowest,
    /// Every second a random node crashes, leaves or is paused for 2 s, or a node joins;
    /// the group size stays around N.
    Churn,
}

impl Scenario {
    /// How often the disruption repeats.
    pub fn period(self) -> Option<Duration> {
        match self {
            Scenario::None | Scenario::Loss => None,
            Scenario::RollingRestart => Some(Duration::from_secs(2)),
            Scenario::PartitionLowest | Scenario::PauseLowest => Some(Duration::from_secs(20)),
            Scenario::CrashLowest => Some(Duration::from_secs(10)),
            Scenario::Churn => Some(Duration::from_secs(1)),
        }
    }
}

/// One simulated run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub nodes: usize,
    /// Of `nodes`, how many follow the old rule whatever `rule` says (mixed versions).
    pub old_nodes: usize,
    pub rule: SimRule,
    pub announcers: usize,
    pub links: Links,
    pub tick: Duration,
    pub announce_interval: Duration,
    pub member_ttl: Duration,
    /// Simulated time measured, after the warm-up.
    pub duration: Duration,
    /// Start-up time left out of the measures (every node settles at first).
    pub warmup: Duration,
    pub scenario: Scenario,
    pub seed: u64,
    pub attack: Attack,
    /// Members prove membership with a group secret (and share their broker user with
    /// the attacker) instead of their own broker user.
    pub secret: bool,
    /// Each replica's host clock is off by an offset drawn uniformly from
    /// `[-clock_skew, +clock_skew]` (from an RNG of its own, so the rest of the run
    /// draws the same numbers whatever the skew).
    pub clock_skew: Duration,
}

impl SimConfig {
    /// The daemon's defaults (config/default.toml): tick 250 ms, announce 1 s, ttl 3 s.
    pub fn new(nodes: usize, rule: SimRule, scenario: Scenario, seed: u64) -> Self {
        Self {
            nodes,
            old_nodes: 0,
            rule,
            announcers: 3,
            links: Links {
                base: Duration::from_millis(1),
                jitter: Duration::ZERO,
                loss: 0.0,
                duplicate: 0.0,
            },
            tick: Duration::from_millis(250),
            announce_interval: Duration::from_secs(1),
            member_ttl: Duration::from_secs(3),
            duration: Duration::from_secs(60),
            warmup: Duration::from_secs(5),
            scenario,
            seed,
            attack: Attack::None,
            secret: false,
            clock_skew: Duration::ZERO,
        }
    }

    /// The election rule of a node that follows `rule`.
    pub fn election_rule(&self, rule: SimRule) -> Rule {
        match rule {
            SimRule::Old => Rule::All,
            SimRule::New => Rule::Lowest {
                announcers: self.announcers,
            },
        }
    }
}
