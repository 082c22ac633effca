//! The daemon as a child process.

use crate::prelude::*;
use crate::*;

/// One "fired batch" (debug) log line of the daemon.
#[derive(Debug, Clone)]
pub(crate) struct BatchLog {
    pub(crate) at: DateTime<Utc>,
    pub(crate) fired: u64,
    pub(crate) duration_ms: f64,
}

#[derive(Default)]
pub(crate) struct DaemonLog {
    pub(crate) active: AtomicBool,
    pub(crate) batches: Mutex<Vec<BatchLog>>,
    pub(crate) tail: Mutex<VecDeque<String>>,
    pub(crate) warnings: AtomicUsize,
}

impl DaemonLog {
    pub(crate) fn batches_between(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<BatchLog> {
        let batches = self.batches.lock().map(|b| b.clone()).unwrap_or_default();
        batches
            .into_iter()
            .filter(|b| b.at >= from && b.at <= to)
            .collect()
    }

    pub(crate) fn tail(&self) -> String {
        let tail = self.tail.lock().map(|t| t.clone()).unwrap_or_default();
        tail.into_iter().collect::<Vec<_>>().join("\n")
    }

    pub(crate) fn read(&self, line: &str) {
        if let Ok(mut tail) = self.tail.lock() {
            if tail.len() >= 20 {
                tail.pop_front();
            }
            tail.push_back(line.to_owned());
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            return;
        };
        let field = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or_default();
        if matches!(field("level"), "WARN" | "ERROR") {
            self.warnings.fetch_add(1, Ordering::Relaxed);
        }
        match field("message") {
            "role changed" => self
                .active
                .store(field("role") == "active", Ordering::Release),
            "fired batch" => self.batch(&v),
            _ => {}
        }
    }

    pub(crate) fn batch(&self, v: &serde_json::Value) {
        let at = v
            .get("timestamp")
            .and_then(|t| t.as_str())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(Utc::now);
        let fired = v.get("fired").and_then(|f| f.as_u64()).unwrap_or(0);
        let duration_ms = v
            .get("duration")
            .and_then(|d| d.as_str())
            .and_then(debug_duration_ms)
            .unwrap_or(0.0);
        if let Ok(mut b) = self.batches.lock() {
            b.push(BatchLog {
                at,
                fired,
                duration_ms,
            });
        }
    }
}

/// A `Debug`-formatted `Duration` ("12.5ms", "850µs", "1.2s") in milliseconds.
pub(crate) fn debug_duration_ms(s: &str) -> Option<f64> {
    let split = s.find(|c: char| c.is_alphabetic())?;
    let (number, unit) = s.split_at(split);
    let number: f64 = number.parse().ok()?;
    let scale = match unit {
        "s" => 1e3,
        "ms" => 1.0,
        "µs" | "us" => 1e-3,
        "ns" => 1e-6,
        _ => return None,
    };
    Some(number * scale)
}

/// Resident memory of the daemon, from /proc/<pid>/status, in bytes.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Mem {
    pub(crate) rss: u64,
    pub(crate) hwm: u64,
}

pub(crate) struct Daemon {
    pub(crate) child: Child,
    pub(crate) pid: u32,
    pub(crate) log: Arc<DaemonLog>,
}

impl Daemon {
    /// Spawn `timeoutd run` and wait until it is the active node (its "role changed" log).
    pub(crate) async fn start(env: &Env) -> Result<Self> {
        let mut cmd = Command::new(&env.daemon_bin);
        cmd.arg("run")
            .envs(env.daemon_env())
            .env(
                "RUST_LOG",
                "warn,timeoutd::daemon=info,timeoutd::scheduler=debug",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", env.daemon_bin.display()))?;
        let pid = child.id().context("daemon has no pid")?;
        let stderr = child.stderr.take().context("daemon stderr")?;
        let log = Arc::new(DaemonLog::default());
        tokio::spawn(read_log(stderr, log.clone()));
        let mut daemon = Self { child, pid, log };
        daemon.wait_active(Duration::from_secs(30)).await?;
        Ok(daemon)
    }

    pub(crate) async fn wait_active(&mut self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        while !self.log.active.load(Ordering::Acquire) {
            if let Some(status) = self.child.try_wait()? {
                bail!("daemon exited ({status}):\n{}", self.log.tail());
            }
            if Instant::now() >= deadline {
                bail!("daemon not active within {limit:?}:\n{}", self.log.tail());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Fails if the daemon has exited (a crash mid-run must not pass unnoticed).
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("daemon exited ({status}):\n{}", self.log.tail());
        }
        Ok(())
    }

    pub(crate) fn memory(&self) -> Result<Mem> {
        let path = format!("/proc/{}/status", self.pid);
        let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        let kib = |key: &str| -> Result<u64> {
            let line = status
                .lines()
                .find(|l| l.starts_with(key))
                .with_context(|| format!("{key} missing in {path}"))?;
            let value = line.trim_start_matches(key).trim().trim_end_matches("kB");
            Ok(value.trim().parse::<u64>()? * 1024)
        };
        Ok(Mem {
            rss: kib("VmRSS:")?,
            hwm: kib("VmHWM:")?,
        })
    }

    /// SIGTERM, then wait (bounded); SIGKILL if it does not stop.
    pub(crate) async fn stop(mut self) -> Result<()> {
        let term = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        if !term.is_ok_and(|s| s.success()) {
            self.child.start_kill()?;
        }
        match tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await {
            Ok(status) if status.as_ref().is_ok_and(|s| s.success()) => Ok(()),
            Ok(status) => bail!("daemon stopped with {status:?}:\n{}", self.log.tail()),
            Err(_) => {
                self.child.start_kill()?;
                bail!("daemon did not stop within 20 s after SIGTERM; killed")
            }
        }
    }
}

pub(crate) async fn read_log(stderr: tokio::process::ChildStderr, log: Arc<DaemonLog>) {
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        log.read(&line);
    }
}
