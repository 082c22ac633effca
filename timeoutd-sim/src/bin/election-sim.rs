//! `election-sim`: one simulated run of the election, printed as one JSON line.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use timeoutd_sim::net::Links;
use timeoutd_sim::{Attack, Scenario, SimConfig, SimRule};

/// Simulate a group of timeoutd nodes (the real election state machines) over a lossy,
/// jittery network in virtual time, and print the measures as one JSON line.
#[derive(Debug, Parser)]
#[command(name = "election-sim")]
struct Args {
    /// Nodes in the group.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Of those, how many follow the old rule whatever --rule says (a mixed-version group).
    #[arg(long, default_value_t = 0)]
    old_nodes: usize,
    /// Fraction of deliveries lost: 0.01, or as a percentage: 1%.
    #[arg(long, default_value = "0", value_parser = parse_fraction)]
    loss: f64,
    /// Fraction of deliveries duplicated: 0.01, or 1%.
    #[arg(long, default_value = "0", value_parser = parse_fraction)]
    duplicate: f64,
    /// Extra delay per delivery, uniform in [0, jitter] (reorders messages): 50ms.
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    jitter: Duration,
    /// Fixed delay per delivery.
    #[arg(long, default_value = "1ms", value_parser = humantime::parse_duration)]
    base_delay: Duration,
    /// Simulated seconds measured (after a 5 s warm-up).
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// old: every node announces every interval; new: the lowest `announcers` do.
    #[arg(long, value_enum, default_value_t = SimRule::New)]
    rule: SimRule,
    /// With the new rule: how many of the lowest candidates announce.
    #[arg(long, default_value_t = 3)]
    announcers: usize,
    #[arg(long, value_enum, default_value_t = Scenario::None)]
    scenario: Scenario,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// An attacker on the announcement exchange, every 100 ms.
    #[arg(long, value_enum, default_value_t = Attack::None)]
    attack: Attack,
    /// Members prove membership with a group secret (the attacker shares their broker
    /// user) instead of their own broker user.
    #[arg(long)]
    secret: bool,
    /// Each node's host clock is off by up to this much either way (uniform): 30s, 10m.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    clock_skew: Duration,
}

/// `0.05` or `5%`, between 0 and 1.
fn parse_fraction(raw: &str) -> Result<f64, String> {
    let (number, scale) = match raw.strip_suffix('%') {
        Some(pct) => (pct, 100.0),
        None => (raw, 1.0),
    };
    let value = number
        .trim()
        .parse::<f64>()
        .map_err(|e| format!("not a number: {e}"))?
        / scale;
    if !(0.0..=1.0).contains(&value) {
        return Err(format!("{raw} is not between 0 and 1 (or 0% and 100%)"));
    }
    Ok(value)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.nodes > 0, "--nodes must be at least 1");
    anyhow::ensure!(
        args.old_nodes <= args.nodes,
        "--old-nodes must not exceed --nodes"
    );
    anyhow::ensure!(args.announcers >= 2, "--announcers must be at least 2");
    let mut cfg = SimConfig::new(args.nodes, args.rule, args.scenario, args.seed);
    cfg.old_nodes = args.old_nodes;
    cfg.announcers = args.announcers;
    cfg.duration = Duration::from_secs(args.seconds);
    cfg.attack = args.attack;
    cfg.secret = args.secret;
    cfg.clock_skew = args.clock_skew;
    cfg.links = Links {
        base: args.base_delay,
        jitter: args.jitter,
        loss: args.loss,
        duplicate: args.duplicate,
    };
    let report = timeoutd_sim::run(&cfg);
    println!(
        "{}",
        serde_json::to_string(&report).context("encoding the report")?
    );
    Ok(())
}
