//! CPU time over a phase by the role of each process on this machine (broker, Postgres,
//! daemons, this bench), from /proc: on a machine where all of them share the cores, a
//! throughput is bounded by the CPU every message costs all of them together, and this
//! shows whose share it is.

use crate::prelude::*;

/// /proc reports CPU times in USER_HZ, 100 on every Linux.
pub(crate) const USER_HZ: f64 = 100.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Broker,
    Postgres,
    /// What fires: the daemons, or the hand-rolled loop's process.
    Firing,
    Bench,
    Other,
}

impl Role {
    fn of(pid: u32, stat: &Stat) -> Self {
        let me = std::process::id();
        if pid == me {
            return Role::Bench;
        }
        // What this bench started fires, whatever its binary is called (a daemon under
        // another name or under a profiler, the hand-rolled loop: this program again).
        if stat.ppid == me {
            return Role::Firing;
        }
        match stat.comm {
            "beam.smp" | "erl_child_setup" | "epmd" | "inet_gethost" => Role::Broker,
            "postgres" => Role::Postgres,
            "timeoutd" => Role::Firing,
            _ => Role::Other,
        }
    }
}

/// CPU ticks of every process at the start of a phase.
pub(crate) struct CpuMeter {
    ticks: HashMap<u32, u64>,
}

/// CPU milliseconds each role spent in a window, and the window.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct CpuSpent {
    pub(crate) window_secs: f64,
    pub(crate) broker_ms: f64,
    pub(crate) postgres_ms: f64,
    /// The daemons, or the hand-rolled loop's process.
    pub(crate) firing_ms: f64,
    pub(crate) bench_ms: f64,
    pub(crate) other_ms: f64,
    pub(crate) cores: usize,
}

impl CpuMeter {
    pub(crate) fn start() -> Self {
        Self {
            ticks: processes()
                .into_iter()
                .map(|(pid, _, t)| (pid, t))
                .collect(),
        }
    }

    /// What each role spent since `start`, over a window of `window_secs` (the phase's
    /// own clock: the meter may have run a little longer, idle). A process that started
    /// meanwhile counts in full; one that ended meanwhile is not seen.
    pub(crate) fn spent(&self, window_secs: f64) -> CpuSpent {
        let mut s = CpuSpent {
            window_secs,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            ..CpuSpent::default()
        };
        for (pid, role, now) in processes() {
            let ms = now.saturating_sub(self.ticks.get(&pid).copied().unwrap_or(0)) as f64
                / USER_HZ
                * 1e3;
            *match role {
                Role::Broker => &mut s.broker_ms,
                Role::Postgres => &mut s.postgres_ms,
                Role::Firing => &mut s.firing_ms,
                Role::Bench => &mut s.bench_ms,
                Role::Other => &mut s.other_ms,
            } += ms;
        }
        s
    }
}

impl CpuSpent {
    pub(crate) fn total_ms(&self) -> f64 {
        self.broker_ms + self.postgres_ms + self.firing_ms + self.bench_ms + self.other_ms
    }

    /// Cores kept busy on average over the window.
    pub(crate) fn busy_cores(&self) -> f64 {
        self.total_ms() / 1e3 / self.window_secs
    }

    /// CPU microseconds per message, by role: "broker 31 µs, Postgres 16 µs, …"; `firing`
    /// names what fired (the daemon, the loop), `bench` what this bench did meanwhile.
    pub(crate) fn per_message_text(&self, messages: usize, firing: &str, bench: &str) -> String {
        let per = |ms: f64| self.per(ms, messages);
        let mut parts = vec![format!("broker {:.0}", per(self.broker_ms))];
        if self.postgres_ms > 0.0 {
            parts.push(format!("Postgres {:.0}", per(self.postgres_ms)));
        }
        if self.firing_ms > 0.0 {
            parts.push(format!("{firing} {:.0}", per(self.firing_ms)));
        }
        parts.push(format!("{bench} {:.0}", per(self.bench_ms)));
        parts.push(format!("other {:.0}", per(self.other_ms)));
        format!(
            "{} = {:.0} µs per message; {:.2} of {} cores busy",
            parts.join(" + "),
            per(self.total_ms()),
            self.busy_cores(),
            self.cores
        )
    }

    pub(crate) fn per_message_us(&self, messages: usize) -> f64 {
        self.per(self.total_ms(), messages)
    }

    /// Microseconds per message of `role_ms` (one role's share) over `messages`.
    pub(crate) fn per(&self, role_ms: f64, messages: usize) -> f64 {
        role_ms * 1e3 / messages.max(1) as f64
    }
}

/// Every process we may read: pid, role, utime + stime in USER_HZ ticks.
fn processes() -> Vec<(u32, Role, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let stat = parse_stat(&stat)?;
        Some((pid, Role::of(pid, &stat), stat.ticks))
    })
    .collect()
}

/// The command name, the parent pid and utime + stime of a `/proc/<pid>/stat` line.
pub(crate) fn parse_stat(stat: &str) -> Option<Stat<'_>> {
    // The command name may hold spaces and parentheses: it ends at the last ')'.
    let (head, rest) = stat.rsplit_once(')')?;
    let (_, comm) = head.split_once('(')?;
    let mut fields = rest.split_whitespace();
    // ppid is field 4 of stat, 2 after the name; utime and stime are fields 14 and 15.
    let ppid: u32 = fields.nth(1)?.parse().ok()?;
    let utime: u64 = fields.nth(9)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Stat {
        comm,
        ppid,
        ticks: utime + stime,
    })
}

/// What the bench reads of `/proc/<pid>/stat`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Stat<'a> {
    pub(crate) comm: &'a str,
    pub(crate) ppid: u32,
    /// utime + stime, in USER_HZ ticks.
    pub(crate) ticks: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_a_strange_name() {
        let stat = "42 (a) b (c)) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 0 0 20 0 1 0 5 0 0";
        let parsed = Stat {
            comm: "a) b (c)",
            ppid: 1,
            ticks: 10,
        };
        assert_eq!(parse_stat(stat), Some(parsed));
        assert_eq!(parse_stat("42 (x) S 1"), None);
    }
}
