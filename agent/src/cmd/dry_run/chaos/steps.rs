//! The ranks' step reports, as each agent serves them on its metrics endpoint
//! (`muster_worker_last_step{local_rank="L"}`, set from the helper's or the zero-code reporter's
//! step reports and cleared between attempts), sampled with the workers.
//!
//! Why the metrics endpoint: it is what the agent itself knows of the step reports, in either log
//! format and whatever the script prints; the dry run learns each agent's (ephemeral) address
//! from its `metrics on http://ADDR/metrics` line. Only changes are kept: a rank's first value,
//! and each new one; a rank that leaves the page (a new attempt, an agent gone) is forgotten, so
//! its next report is a change even at the same step.
//!
//! The dry run's agents listen on loopback only, and the dry run only reads; an agent's endpoint
//! is documented in docs/metrics.md (who may call it: anyone who reaches it, read-only).

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use tokio::time::Instant;

/// How long one read of an agent's page may take: the sample runs on the dry run's loop, which
/// must keep pumping output; a loopback page comes in a millisecond or two.
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(200);
/// The most of a page read (a few dozen families: tens of KiB).
const MAX_PAGE_BYTES: u64 = 4 << 20;

/// One change of one rank's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub at: Instant,
    pub node: u32,
    pub local_rank: u32,
    pub step: u64,
}

/// The step samples of one dry run.
#[derive(Debug, Default)]
pub struct Steps {
    addrs: HashMap<u32, SocketAddr>,
    last: HashMap<(u32, u32), u64>,
    samples: Vec<Sample>,
}

impl Steps {
    /// Learns node `node`'s metrics address from one of its agent's messages.
    pub fn learn(&mut self, node: u32, agent_message: &str) {
        if let Some(addr) = agent_message
            .strip_prefix("metrics on http://")
            .and_then(|rest| rest.strip_suffix("/metrics"))
            .and_then(|a| a.parse().ok())
        {
            self.addrs.insert(node, addr);
        }
    }

    /// Whether any agent's endpoint is known (metrics may be off).
    pub fn any_endpoint(&self) -> bool {
        !self.addrs.is_empty()
    }

    /// Reads every known endpoint once and keeps the changes.
    pub fn sample(&mut self, at: Instant) {
        let mut nodes: Vec<(u32, SocketAddr)> = self.addrs.iter().map(|(n, a)| (*n, *a)).collect();
        nodes.sort_unstable();
        for (node, addr) in nodes {
            let page = scrape(addr).unwrap_or_default();
            self.observe(at, node, &last_steps(&page));
        }
    }

    /// One page's steps of `node` (empty: the agent is gone or between attempts).
    pub fn observe(&mut self, at: Instant, node: u32, steps: &[(u32, u64)]) {
        self.last
            .retain(|(n, l), _| *n != node || steps.iter().any(|(local, _)| local == l));
        for &(local_rank, step) in steps {
            if self.last.insert((node, local_rank), step) != Some(step) {
                self.samples.push(Sample {
                    at,
                    node,
                    local_rank,
                    step,
                });
            }
        }
    }

    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }
}

/// `GET /metrics` over HTTP/1.0 (the server closes after the answer); `None` on any failure.
fn scrape(addr: SocketAddr) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(&addr, SCRAPE_TIMEOUT).ok()?;
    stream.set_read_timeout(Some(SCRAPE_TIMEOUT)).ok()?;
    stream.set_write_timeout(Some(SCRAPE_TIMEOUT)).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: muster\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    stream.take(MAX_PAGE_BYTES).read_to_string(&mut body).ok()?;
    Some(body)
}

/// The `muster_worker_last_step` samples of a Prometheus text page: `(local_rank, step)`.
pub fn last_steps(page: &str) -> Vec<(u32, u64)> {
    page.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("muster_worker_last_step{")?;
            let (labels, value) = rest.split_once('}')?;
            let local = labels
                .split(',')
                .find_map(|l| l.trim().strip_prefix("local_rank=\""))?
                .strip_suffix('"')?
                .parse()
                .ok()?;
            let value: f64 = value.trim().parse().ok()?;
            // A step is a whole, non-negative number well inside f64's exact range.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let step = (value.is_finite() && value >= 0.0).then_some(value as u64)?;
            Some((local, step))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_gives_each_local_ranks_step() {
        let page = "# HELP muster_worker_last_step x\n# TYPE muster_worker_last_step gauge\n\
                    muster_worker_last_step{local_rank=\"0\"} 120\n\
                    muster_worker_last_step{local_rank=\"1\"} 119\n\
                    muster_worker_last_step_age_seconds{local_rank=\"0\"} 0.1\n\
                    muster_worker_last_step{local_rank=\"x\"} 3\n";
        assert_eq!(last_steps(page), [(0, 120), (1, 119)]);
        assert!(last_steps("").is_empty());
    }

    #[test]
    fn only_changes_are_kept_and_a_rank_that_left_comes_back_as_a_change() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Steps::default();
        s.observe(ms(0), 1, &[(0, 5), (1, 5)]);
        s.observe(ms(100), 1, &[(0, 5), (1, 6)]);
        s.observe(ms(200), 1, &[]);
        s.observe(ms(300), 1, &[(0, 5)]);
        let got: Vec<(u64, u32, u64)> = s
            .samples()
            .iter()
            .map(|x| {
                (
                    x.at.duration_since(t0).as_millis() as u64,
                    x.local_rank,
                    x.step,
                )
            })
            .collect();
        assert_eq!(got, [(0, 0, 5), (0, 1, 5), (100, 1, 6), (300, 0, 5)]);
    }

    #[test]
    fn the_address_comes_from_the_agents_line() {
        let mut s = Steps::default();
        assert!(!s.any_endpoint());
        s.learn(2, "metrics on http://127.0.0.1:4321/metrics");
        s.learn(2, "round 0: something else");
        assert_eq!(s.addrs.get(&2), Some(&"127.0.0.1:4321".parse().unwrap()));
    }
}
