//! The daemon as a child process.

use crate::prelude::*;
use crate::*;

/// The daemon's stderr: the last lines (shown when it dies) and a count of warnings.
#[derive(Default)]
pub(crate) struct DaemonLog {
    pub(crate) tail: Mutex<VecDeque<String>>,
    pub(crate) warnings: AtomicUsize,
}

impl DaemonLog {
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
        let level = v.get("level").and_then(|x| x.as_str()).unwrap_or_default();
        if matches!(level, "WARN" | "ERROR") {
            self.warnings.fetch_add(1, Ordering::Relaxed);
        }
    }
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
    /// Where the daemon serves `/metrics`.
    pub(crate) http: SocketAddr,
}

impl Daemon {
    /// Spawn `timeoutd run` on a port of its own and wait until its `/metrics` says active.
    pub(crate) async fn start(env: &Env) -> Result<Self> {
        let mut daemon = Self::spawn(env)?;
        daemon.wait_active(Duration::from_secs(30)).await?;
        Ok(daemon)
    }

    /// Spawn `timeoutd run` on a port of its own, without waiting for anything.
    pub(crate) fn spawn(env: &Env) -> Result<Self> {
        Self::spawn_in(env, &env.schema, &env.group, free_local_addr()?)
    }

    /// As [`Daemon::spawn`], in another schema and group than the run's own, serving
    /// HTTP on `http`.
    pub(crate) fn spawn_in(env: &Env, schema: &str, group: &str, http: SocketAddr) -> Result<Self> {
        let mut cmd = Command::new(&env.daemon_bin);
        cmd.arg("run")
            .envs(env.daemon_env(http, schema, group))
            .env("RUST_LOG", &env.daemon_rust_log)
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
        let copy = match &env.daemon_log {
            Some(dir) => Some(log_file(dir, pid)?),
            None => None,
        };
        tokio::spawn(read_log(stderr, log.clone(), copy));
        Ok(Self {
            child,
            pid,
            log,
            http,
        })
    }

    /// Polls `/metrics` until `timeoutd_active` is 1; refused connections are expected
    /// while the daemon starts.
    pub(crate) async fn wait_active(&mut self, limit: Duration) -> Result<()> {
        self.wait_gauge(ACTIVE, limit).await
    }

    /// Polls `/metrics` until the gauge `name` is 1.
    pub(crate) async fn wait_gauge(&mut self, name: &str, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            self.check_alive()?;
            let last = match scrape(self.http).await {
                Ok(s) if s.get(name) == Some(1.0) => return Ok(()),
                Ok(s) => format!("{name} = {:?}", s.get(name)),
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() >= deadline {
                bail!(
                    "daemon: {name} not 1 within {limit:?} (last scrape: {last}):\n{}",
                    self.log.tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) async fn scrape(&mut self) -> Result<Scrape> {
        self.check_alive()?;
        scrape(self.http).await
    }

    /// Scrape until the daemon counts `fired` more TimeOuts than in `before`, for at most
    /// `limit`: the consumer can hold a TimeOut before its batch committed and was counted.
    pub(crate) async fn scrape_after(
        &mut self,
        before: &Scrape,
        fired: u64,
        limit: Duration,
    ) -> Result<Scrape> {
        let deadline = Instant::now() + limit;
        loop {
            let now = self.scrape().await?;
            let counted = ScanDelta::between(before, &now).fired;
            if counted >= fired || Instant::now() >= deadline {
                return Ok(now);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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
        self.terminate().await
    }

    /// As [`Daemon::stop`], keeping the handle: a daemon that has already exited is not
    /// signalled again, its exit is judged as it was.
    pub(crate) async fn terminate(&mut self) -> Result<()> {
        if self.child.try_wait()?.is_none() {
            let term = std::process::Command::new("kill")
                .args(["-TERM", &self.pid.to_string()])
                .status();
            if !term.is_ok_and(|s| s.success()) {
                self.child.start_kill()?;
            }
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

/// A port free right now: bind port 0 and let it go. Another process could take it
/// before the daemon binds; the daemon then fails to start and its log says why.
pub(crate) fn free_local_addr() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?)
}

/// Read the daemon's stderr into `log`, and a copy into `copy` if given (a failed write
/// stops the copy, not the bench).
pub(crate) async fn read_log(
    stderr: tokio::process::ChildStderr,
    log: Arc<DaemonLog>,
    mut copy: Option<std::io::BufWriter<std::fs::File>>,
) {
    use std::io::Write;
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        log.read(&line);
        if let Some(file) = &mut copy
            && writeln!(file, "{line}").is_err()
        {
            copy = None;
        }
    }
}

fn log_file(dir: &Path, pid: u32) -> Result<std::io::BufWriter<std::fs::File>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("daemon-{pid}.log"));
    let file =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    Ok(std::io::BufWriter::new(file))
}
