//! The registry's content and the endpoint over real sockets on 127.0.0.1 (raw bytes in, raw
//! bytes out), with short timeouts.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::checkpoint::requests::RequestSlot;

const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// One sample line of the text format: `name{labels} value`.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn is_metric_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_' || b == b':')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
}

/// Parses the exposition strictly enough to catch format mistakes: every sample belongs to a
/// family with HELP and TYPE, names and label names are valid, values are numbers.
fn parse_exposition(text: &str) -> Vec<Sample> {
    let mut typed: BTreeMap<String, String> = BTreeMap::new();
    let mut helped: BTreeSet<String> = BTreeSet::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(is_metric_name(name), "bad name in {line:?}");
            assert!(helped.insert(name.to_owned()), "duplicate HELP {line:?}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line:?}"
            );
            assert!(typed.insert(name.to_owned(), kind.to_owned()).is_none());
            continue;
        }
        assert!(!line.starts_with('#'), "unexpected comment {line:?}");
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').unwrap();
                let mut labels = BTreeMap::new();
                for pair in body.split("\",").filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once("=\"").unwrap();
                    assert!(
                        is_metric_name(k) && !k.contains(':'),
                        "label {k:?} in {line:?}"
                    );
                    labels.insert(k.to_owned(), v.trim_end_matches('"').to_owned());
                }
                (name, labels)
            }
        };
        assert!(is_metric_name(name), "bad name in {line:?}");
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                let base = name.strip_suffix(suffix)?;
                (typed.get(base).map(String::as_str) == Some("histogram")).then_some(base)
            })
            .unwrap_or(name);
        assert!(typed.contains_key(family), "no TYPE for {line:?}");
        assert!(helped.contains(family), "no HELP for {line:?}");
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    samples
}

fn scrape(metrics: &Metrics) -> Vec<Sample> {
    parse_exposition(&String::from_utf8(metrics.encode()).unwrap())
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

#[test]
fn a_fresh_registry_exports_well_formed_text_with_the_known_label_sets_at_zero() {
    let metrics = Metrics::new();
    let samples = scrape(&metrics);
    assert_eq!(
        value(
            &samples,
            "muster_build_info",
            &[
                ("version", env!("CARGO_PKG_VERSION")),
                ("protocol", STORE_PROTOCOL)
            ]
        ),
        Some(1.0)
    );
    assert!(value(&samples, "muster_start_time_seconds", &[]).unwrap() > 1.7e9);
    assert_eq!(
        value(&samples, "muster_agent_phase", &[("phase", "resolving")]),
        Some(1.0)
    );
    for cause in [
        "worker_failure",
        "peer_failure",
        "membership_change",
        "hang",
    ] {
        assert_eq!(
            value(&samples, "muster_restarts_total", &[("cause", cause)]),
            Some(0.0)
        );
    }
    for outcome in ["completed", "timeout", "failed", "cancelled"] {
        assert_eq!(
            value(
                &samples,
                "muster_rendezvous_rounds_total",
                &[("outcome", outcome)]
            ),
            Some(0.0)
        );
    }
    assert_eq!(
        value(&samples, "muster_rendezvous_duration_seconds_count", &[]),
        Some(0.0)
    );
    // Process metrics come from /proc of this very process.
    assert!(value(&samples, "process_resident_memory_bytes", &[]).unwrap() > 0.0);
    // No store hosted yet: no store series.
    assert!(samples.iter().all(|s| !s.name.starts_with("muster_store_")));
}

#[test]
fn a_timed_restart_observes_each_phase_and_every_phase_starts_at_zero() {
    use crate::launch::restart_timeline::{RestartCost, RestartPhase};
    let metrics = Metrics::new();
    for phase in RestartPhase::ALL {
        assert_eq!(
            value(
                &scrape(&metrics),
                "muster_restart_phase_seconds_count",
                &[("phase", phase.as_str())]
            ),
            Some(0.0),
            "{phase:?}"
        );
    }
    let cost = RestartCost {
        restart_count: 1,
        node_rank: 0,
        phases: vec![
            (RestartPhase::Stop, Duration::from_millis(20)),
            (RestartPhase::Spawn, Duration::from_millis(3)),
            (RestartPhase::FirstStep, Duration::from_millis(700)),
        ],
        warm: 2,
        ranks: 2,
    };
    metrics.restarts().timed(&cost);
    let samples = scrape(&metrics);
    let count = |phase: &str| {
        value(
            &samples,
            "muster_restart_phase_seconds_count",
            &[("phase", phase)],
        )
    };
    assert_eq!(count("stop"), Some(1.0));
    assert_eq!(count("first_step"), Some(1.0));
    // A rank without init_process_group has no such phase: nothing observed for it.
    assert_eq!(count("init_process_group"), Some(0.0));
    let sum = value(
        &samples,
        "muster_restart_phase_seconds_sum",
        &[("phase", "first_step")],
    )
    .unwrap();
    assert!((sum - 0.7).abs() < 1e-9, "{sum}");
}

/// The GPU watch as the metrics see it on an 8-GPU node: every GPU read, GPU 3 throttled and
/// with NVLink replays, XIDs on GPU 1.
pub(super) fn gpu_watch_of_eight() -> crate::gpu::watch::Watch {
    use crate::gpu::watch::{EventKind, GpuEvent, GpuId, GpuSample, NodeSample, NvLinkErrors};
    let watch = crate::gpu::watch::Watch::new();
    let gpus = (0..8)
        .map(|i| GpuSample {
            gpu: GpuId {
                index: i,
                uuid: Some(format!("GPU-{i}")),
                pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x18 + i)),
            },
            lost: false,
            utilization_ratio: Some(0.25 * f64::from(i % 4)),
            memory_used_bytes: Some(u64::from(i) << 30),
            memory_total_bytes: Some(80 << 30),
            power_watts: Some(350.5),
            temperature_celsius: Some(60 + i),
            throttle_reasons: Some(if i == 3 { 0x40 | 0x1 } else { 0x1 }),
            sm_clock_mhz: Some(1980),
            sm_clock_max_mhz: Some(1980),
            ecc_volatile_uncorrected: Some(u64::from(i == 2)),
            row_remap_pending: Some(false),
            recovery_action: Some(0),
            nvlink: Some(NvLinkErrors {
                replay: if i == 3 { 40 } else { 0 },
                ..NvLinkErrors::default()
            }),
        })
        .collect::<Vec<_>>();
    for xid in [13, 13, 94] {
        watch.record(GpuEvent {
            gpu: gpus[1].gpu.clone(),
            at: std::time::SystemTime::now(),
            kind: EventKind::Xid(xid),
        });
    }
    watch.publish(NodeSample {
        at: Some(std::time::SystemTime::now()),
        gpus,
    });
    watch
}

#[test]
fn the_gpu_watch_is_exported_per_gpu_with_dcgm_labels() {
    let metrics = Metrics::new();
    assert!(
        scrape(&metrics)
            .iter()
            .all(|s| !s.name.starts_with("muster_gpu_utilization")),
        "no watch, no GPU series"
    );
    metrics.attach_gpu_watch(gpu_watch_of_eight());
    let samples = scrape(&metrics);
    let gpu = |i: &'static str| [("gpu", i)];
    assert_eq!(
        value(&samples, "muster_gpu_utilization_ratio", &gpu("2")),
        Some(0.5)
    );
    assert_eq!(
        value(
            &samples,
            "muster_gpu_memory_used_bytes",
            &[
                ("gpu", "3"),
                ("UUID", "GPU-3"),
                ("pci_bus_id", "00000000:1B:00.0")
            ]
        ),
        Some(3.0 * 1024.0 * 1024.0 * 1024.0)
    );
    assert_eq!(
        value(&samples, "muster_gpu_memory_total_bytes", &gpu("0")),
        Some(85_899_345_920.0)
    );
    assert_eq!(
        value(&samples, "muster_gpu_power_watts", &gpu("7")),
        Some(350.5)
    );
    assert_eq!(
        value(&samples, "muster_gpu_temperature_celsius", &gpu("7")),
        Some(67.0)
    );
    assert_eq!(
        value(
            &samples,
            "muster_gpu_ecc_uncorrected_errors_total",
            &gpu("2")
        ),
        Some(1.0)
    );
    assert_eq!(
        value(&samples, "muster_gpu_row_remap_pending", &gpu("2")),
        Some(0.0)
    );
    assert_eq!(value(&samples, "muster_gpu_lost", &gpu("2")), Some(0.0));
    assert_eq!(
        value(
            &samples,
            "muster_gpu_throttled",
            &[("gpu", "3"), ("reason", "hw_thermal_slowdown")]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            &samples,
            "muster_gpu_throttled",
            &[("gpu", "4"), ("reason", "hw_thermal_slowdown")]
        ),
        Some(0.0)
    );
    assert_eq!(
        value(
            &samples,
            "muster_gpu_nvlink_errors_total",
            &[("gpu", "3"), ("counter", "replay")]
        ),
        Some(40.0)
    );
    assert_eq!(
        value(
            &samples,
            "muster_gpu_xid_errors_total",
            &[("gpu", "1"), ("xid", "13"), ("UUID", "GPU-1")]
        ),
        Some(2.0)
    );
    assert_eq!(
        value(
            &samples,
            "muster_gpu_xid_errors_total",
            &[("gpu", "1"), ("xid", "94")]
        ),
        Some(1.0)
    );
    assert!(
        value(
            &samples,
            "muster_gpu_watch_last_sample_timestamp_seconds",
            &[]
        )
        .unwrap()
            > 1e9
    );
    let per_gpu = samples
        .iter()
        .filter(|s| s.name == "muster_gpu_utilization_ratio")
        .count();
    assert_eq!(per_gpu, 8);
}

#[test]
fn every_muster_name_follows_the_conventions() {
    let metrics = Metrics::new();
    let names = metrics.metric_names();
    let muster: Vec<&String> = names.iter().filter(|n| n.starts_with("muster_")).collect();
    assert!(muster.len() >= 40, "{muster:?}");
    for name in muster {
        assert!(is_metric_name(name), "{name}");
        assert!(!name.contains("__"), "{name}");
        for unit in ["_ms", "_milliseconds", "_minutes", "_kb", "_mb"] {
            assert!(!name.contains(unit), "{name} is not in base units");
        }
    }
    // Counters end in _total, and only counters do.
    let metrics_text = String::from_utf8(metrics.encode()).unwrap();
    for line in metrics_text
        .lines()
        .filter(|l| l.starts_with("# TYPE muster_"))
    {
        let mut parts = line.split(' ').skip(2);
        let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
        assert_eq!(name.ends_with("_total"), kind == "counter", "{line}");
    }
}

#[test]
fn the_phase_is_a_consistent_state_set() {
    let metrics = Metrics::new();
    for phase in Phase::ALL {
        metrics.set_phase(phase);
        assert_eq!(metrics.phase(), phase);
        let samples = scrape(&metrics);
        let phases: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.name == "muster_agent_phase")
            .collect();
        assert_eq!(phases.len(), Phase::ALL.len());
        let on: Vec<&str> = phases
            .iter()
            .filter(|s| s.value > 0.5)
            .map(|s| s.labels["phase"].as_str())
            .collect();
        assert_eq!(on, [phase.as_str()]);
    }
}

#[test]
// One event of each kind against one registry, so a series moved by the wrong event shows; a
// test reads best as one list (the 150-line bound is for code, clippy.toml).
#[allow(clippy::too_many_lines)]
fn events_move_the_right_series() {
    let metrics = Metrics::new();
    metrics.job().set_run_id("job-42");
    metrics.dns().dns_attempt(DnsResult::NxDomain);
    metrics.dns().dns_attempt(DnsResult::NxDomain);
    metrics.dns().dns_attempt(DnsResult::Ok);
    metrics
        .dns()
        .dns_resolution_finished(Duration::from_millis(2500));
    metrics.rdzv().rendezvous_nodes(3, 2);
    metrics.rdzv().rendezvous_round_finished(
        RoundOutcome::Completed,
        "all_joined",
        Duration::from_millis(1500),
    );
    metrics.rdzv().set_assignment(1, 3, 12, 4);
    metrics.workers().workers_started(4);
    metrics.workers().worker_exited(WorkerExit::Code(3));
    metrics.workers().worker_exited(WorkerExit::Signal(9));
    metrics.workers().worker_exited(WorkerExit::Code(-1));
    metrics.workers().restarted(RestartCause::WorkerFailure);
    metrics.workers().set_restarts_remaining(2);
    metrics.workers().worker_step(0, 120);
    metrics.workers().worker_step(MAX_LOCAL_RANKS, 1);
    metrics.signals().signal_received(15);
    metrics
        .preflight()
        .gpu_check(Some(0), "GPU-abc", "ecc_uncorrectable", false);
    metrics
        .preflight()
        .gpu_check(Some(MAX_GPUS), "GPU-far", "ecc_uncorrectable", false);
    metrics.preflight().gpu_check(None, "", "driver", true);
    metrics
        .preflight()
        .gpu_nvlink_active_links(0, "GPU-abc", 18);
    metrics
        .preflight()
        .gpu_preflight_finished(false, Duration::from_millis(300));
    metrics
        .checkpoints()
        .checkpoint_requested(CheckpointTrigger::Signal);
    metrics
        .checkpoints()
        .set_checkpoint_phase(CheckpointPhase::Saving);
    let samples = scrape(&metrics);
    let v = |name: &str, labels: &[(&str, &str)]| value(&samples, name, labels);

    assert_eq!(v("muster_job_info", &[("run_id", "job-42")]), Some(1.0));
    assert_eq!(
        v(
            "muster_dns_resolution_attempts_total",
            &[("result", "nxdomain")]
        ),
        Some(2.0)
    );
    assert_eq!(
        v("muster_dns_resolution_attempts_total", &[("result", "ok")]),
        Some(1.0)
    );
    assert_eq!(
        v("muster_dns_resolution_duration_seconds_sum", &[]),
        Some(2.5)
    );
    assert_eq!(v("muster_rendezvous_nodes_expected", &[]), Some(3.0));
    assert_eq!(v("muster_rendezvous_nodes_joined", &[]), Some(2.0));
    assert_eq!(v("muster_rendezvous_nodes_waiting", &[]), Some(1.0));
    assert_eq!(
        v(
            "muster_rendezvous_rounds_total",
            &[("outcome", "completed")]
        ),
        Some(1.0)
    );
    assert_eq!(
        v("muster_rendezvous_duration_seconds_count", &[]),
        Some(1.0)
    );
    assert_eq!(
        v(
            "muster_rendezvous_duration_seconds_bucket",
            &[("le", "2.5")]
        ),
        Some(1.0)
    );
    assert_eq!(
        v("muster_rendezvous_duration_seconds_bucket", &[("le", "1")]),
        Some(0.0)
    );
    assert_eq!(
        v(
            "muster_rendezvous_last_round",
            &[("outcome", "completed"), ("reason", "all_joined")]
        ),
        Some(1.0)
    );
    assert!(v("muster_rendezvous_last_round_timestamp_seconds", &[]).unwrap() > 1.7e9);
    assert_eq!(v("muster_node_rank", &[]), Some(1.0));
    assert_eq!(v("muster_group_world_size", &[]), Some(3.0));
    assert_eq!(v("muster_world_size", &[]), Some(12.0));
    assert_eq!(v("muster_local_world_size", &[]), Some(4.0));
    assert_eq!(v("muster_local_workers_running", &[]), Some(1.0));
    assert_eq!(
        v(
            "muster_worker_exits_total",
            &[("code", "3"), ("signal", "none")]
        ),
        Some(1.0)
    );
    assert_eq!(
        v(
            "muster_worker_exits_total",
            &[("code", "137"), ("signal", "SIGKILL")]
        ),
        Some(1.0)
    );
    assert_eq!(
        v(
            "muster_worker_exits_total",
            &[("code", "0"), ("signal", "none")]
        ),
        Some(1.0),
        "negative codes clamp into 0..=255"
    );
    assert_eq!(
        v("muster_restarts_total", &[("cause", "worker_failure")]),
        Some(1.0)
    );
    assert_eq!(v("muster_restarts_remaining", &[]), Some(2.0));
    assert_eq!(
        v("muster_worker_last_step", &[("local_rank", "0")]),
        Some(120.0)
    );
    assert!(
        v(
            "muster_worker_last_step_age_seconds",
            &[("local_rank", "0")]
        )
        .unwrap()
            < 5.0
    );
    assert_eq!(
        v(
            "muster_worker_last_step",
            &[("local_rank", &MAX_LOCAL_RANKS.to_string())]
        ),
        None
    );
    assert_eq!(
        v("muster_signals_received_total", &[("signal", "SIGTERM")]),
        Some(1.0)
    );
    assert_eq!(
        v(
            "muster_gpu_check_healthy",
            &[
                ("gpu", "0"),
                ("UUID", "GPU-abc"),
                ("check", "ecc_uncorrectable")
            ]
        ),
        Some(0.0)
    );
    assert_eq!(v("muster_gpu_check_healthy", &[("UUID", "GPU-far")]), None);
    assert_eq!(
        v(
            "muster_gpu_check_healthy",
            &[("gpu", "node"), ("check", "driver")]
        ),
        Some(1.0)
    );
    assert_eq!(
        v("muster_gpu_nvlink_active_links", &[("gpu", "0")]),
        Some(18.0)
    );
    assert_eq!(v("muster_gpu_preflight_healthy", &[]), Some(0.0));
    assert_eq!(
        v("muster_checkpoint_requests_total", &[("trigger", "signal")]),
        Some(1.0)
    );
    assert_eq!(
        v("muster_checkpoint_phase", &[("phase", "saving")]),
        Some(1.0)
    );
    assert_eq!(
        v("muster_checkpoint_phase", &[("phase", "idle")]),
        Some(0.0)
    );

    metrics.checkpoints().checkpoint_finished(
        CheckpointOutcome::Committed,
        Duration::from_secs(7),
        Some(130),
    );
    metrics.workers().workers_stopped();
    metrics.workers().worker_exited(WorkerExit::Signal(15));
    metrics.workers().workers_started(4);
    let samples = scrape(&metrics);
    let v = |name: &str, labels: &[(&str, &str)]| value(&samples, name, labels);
    assert_eq!(
        v("muster_checkpoints_total", &[("outcome", "committed")]),
        Some(1.0)
    );
    assert_eq!(
        v(
            "muster_checkpoint_duration_seconds_sum",
            &[("outcome", "committed")]
        ),
        Some(7.0)
    );
    assert_eq!(v("muster_last_checkpoint_step", &[]), Some(130.0));
    assert_eq!(
        v("muster_checkpoint_phase", &[("phase", "idle")]),
        Some(1.0)
    );
    assert_eq!(v("muster_local_workers_running", &[]), Some(4.0));
    assert_eq!(
        v("muster_worker_last_step", &[("local_rank", "0")]),
        None,
        "a new worker group starts without the old attempt's steps"
    );
}

#[test]
fn label_values_stay_bounded() {
    assert_eq!(signal_name(9), "SIGKILL");
    assert_eq!(signal_name(40), "SIG40");
    assert_eq!(signal_name(0), "unknown");
    assert_eq!(signal_name(1000), "unknown");
    assert_eq!(WorkerExit::Code(70000).labels().0, "255");
    let metrics = Metrics::new();
    metrics.job().set_run_id(&"é".repeat(200));
    metrics.job().set_run_id("second");
    let samples = scrape(&metrics);
    let infos: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == "muster_job_info")
        .collect();
    assert_eq!(infos.len(), 1, "one job_info series at a time");
    assert_eq!(infos[0].labels["run_id"], "second");
    assert_eq!(truncate(&"é".repeat(200), 5), "éé");
    for i in 0..MAX_GPU_CHECKS + 10 {
        metrics
            .preflight()
            .gpu_check(Some(0), "GPU-a", &format!("check_{i}"), true);
    }
    let checks = scrape(&metrics)
        .iter()
        .filter(|s| s.name == "muster_gpu_check_healthy")
        .count();
    assert_eq!(checks, MAX_GPU_CHECKS);
}

#[test]
fn the_gang_root_cause_is_one_series_replaced_by_the_next_failed_attempt() {
    use crate::launch::gang_cause::PostedFailure;
    let metrics = Metrics::new();
    let mut root = PostedFailure {
        node_rank: 1,
        host: "trainer-1".into(),
        rank: 3,
        local_rank: 1,
        pid: 42,
        status: "exit code 1".into(),
        worker_exit_code: Some(1),
        signal: None,
        exit_code: 1,
        error: Some("ValueError: x".into()),
        at_unix_ms: 0,
    };
    metrics.workers().set_gang_root_cause(&root);
    root.node_rank = 2;
    root.rank = 5;
    metrics.workers().set_gang_root_cause(&root);
    let samples = scrape(&metrics);
    let series: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == "muster_gang_root_cause_info")
        .collect();
    assert_eq!(series.len(), 1, "one series: the last failed attempt's");
    let labels = &series[0].labels;
    assert_eq!(
        (
            labels["node_rank"].as_str(),
            labels["host"].as_str(),
            labels["rank"].as_str(),
            labels["local_rank"].as_str(),
            labels["exit_code"].as_str()
        ),
        ("2", "trainer-1", "5", "1", "1")
    );
    assert!((series[0].value - 1.0).abs() < f64::EPSILON);
}

#[tokio::test(start_paused = true)]
async fn ages_and_the_grace_budget_are_measured_at_scrape_time() {
    let metrics = Metrics::new();
    metrics.signals().set_grace_period(Duration::from_secs(30));
    metrics.workers().worker_step(2, 7);
    tokio::time::advance(Duration::from_secs(12)).await;
    let samples = scrape(&metrics);
    assert_eq!(
        value(&samples, "muster_grace_remaining_seconds", &[]),
        Some(30.0)
    );
    assert_eq!(
        value(
            &samples,
            "muster_worker_last_step_age_seconds",
            &[("local_rank", "2")]
        ),
        Some(12.0)
    );
    assert_eq!(
        value(&samples, "muster_agent_heartbeat_age_seconds", &[]),
        Some(12.0)
    );
    metrics.heartbeat();
    metrics
        .signals()
        .grace_deadline(Instant::now() + Duration::from_secs(20));
    tokio::time::advance(Duration::from_secs(5)).await;
    let samples = scrape(&metrics);
    assert_eq!(
        value(&samples, "muster_grace_remaining_seconds", &[]),
        Some(15.0)
    );
    assert_eq!(
        value(&samples, "muster_agent_heartbeat_age_seconds", &[]),
        Some(5.0)
    );
    tokio::time::advance(Duration::from_secs(60)).await;
    let samples = scrape(&metrics);
    assert_eq!(
        value(&samples, "muster_grace_remaining_seconds", &[]),
        Some(0.0)
    );
}

/// A store whose counters the test moves by hand.
#[derive(Default)]
struct FakeStore {
    connections: AtomicU64,
    sets: AtomicU64,
    received: AtomicU64,
}

impl StoreStatsSource for FakeStore {
    fn snapshot(&self) -> StoreSnapshot {
        StoreSnapshot {
            connections: self.connections.load(Ordering::Relaxed),
            connections_accepted: 1,
            connections_refused: 0,
            protocol_errors: 0,
            keys: 3,
            operations: vec![("set", self.sets.load(Ordering::Relaxed)), ("get", 1)],
            received_bytes: self.received.load(Ordering::Relaxed),
            sent_bytes: 10,
            waiters: 1,
        }
    }
}

#[test]
fn store_counters_stay_monotonic_across_fresh_stores() {
    let metrics = Metrics::new();
    let first = Arc::new(FakeStore::default());
    first.connections.store(4, Ordering::Relaxed);
    first.sets.store(5, Ordering::Relaxed);
    first.received.store(100, Ordering::Relaxed);
    metrics.attach_store(StoreRole::Workers, first.clone());
    let samples = scrape(&metrics);
    let v = |s: &[Sample], name: &str, labels: &[(&str, &str)]| value(s, name, labels);
    assert_eq!(
        v(
            &samples,
            "muster_store_connections",
            &[("store", "workers")]
        ),
        Some(4.0)
    );
    assert_eq!(
        v(&samples, "muster_store_waiters", &[("store", "workers")]),
        Some(1.0)
    );
    assert_eq!(
        v(
            &samples,
            "muster_store_operations_total",
            &[("store", "workers"), ("command", "set")]
        ),
        Some(5.0)
    );
    assert_eq!(
        v(
            &samples,
            "muster_store_connections",
            &[("store", "rendezvous")]
        ),
        None,
        "a role never hosted has no series"
    );

    // The next attempt gets a fresh store whose counters restart at zero.
    metrics.attach_store(StoreRole::Workers, Arc::new(FakeStore::default()));
    let samples = scrape(&metrics);
    assert_eq!(
        v(
            &samples,
            "muster_store_operations_total",
            &[("store", "workers"), ("command", "set")]
        ),
        Some(5.0)
    );
    assert_eq!(
        v(
            &samples,
            "muster_store_operations_total",
            &[("store", "workers"), ("command", "get")]
        ),
        Some(2.0)
    );
    assert_eq!(
        v(
            &samples,
            "muster_store_received_bytes_total",
            &[("store", "workers")]
        ),
        Some(100.0)
    );
    assert_eq!(
        v(
            &samples,
            "muster_store_sent_bytes_total",
            &[("store", "workers")]
        ),
        Some(20.0)
    );
    assert_eq!(
        v(
            &samples,
            "muster_store_connections",
            &[("store", "workers")]
        ),
        Some(0.0)
    );

    metrics.detach_store(StoreRole::Workers);
    let samples = scrape(&metrics);
    assert_eq!(
        v(&samples, "muster_store_waiters", &[("store", "workers")]),
        Some(0.0)
    );
    assert_eq!(
        v(
            &samples,
            "muster_store_operations_total",
            &[("store", "workers"), ("command", "get")]
        ),
        Some(2.0)
    );
}

/// Every `muster_*` identifier in `text` (histogram series suffixes kept).
fn referenced_names(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut referenced = BTreeSet::new();
    let mut i = 0;
    while let Some(pos) = text[i..].find("muster_") {
        let start = i + pos;
        let end = start
            + bytes[start..]
                .iter()
                .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
                .count();
        if start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_') {
            referenced.insert(text[start..end].to_owned());
        }
        i = end;
    }
    referenced
}

fn assert_defined(file: &str, referenced: &BTreeSet<String>) {
    let defined: BTreeSet<String> = Metrics::new().metric_names().into_iter().collect();
    for name in referenced {
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|base| defined.contains(*base))
            })
            .unwrap_or(name);
        assert!(
            defined.contains(base),
            "{file} uses {name}, which muster does not define"
        );
    }
}

#[test]
fn the_dashboard_and_alerts_only_reference_metrics_the_agent_defines() {
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let dashboard_path = format!("{examples}/grafana/muster-dashboard.json");
    let text = std::fs::read_to_string(&dashboard_path).expect("the example dashboard exists");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 20);
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let targets = panel["targets"]
            .as_array()
            .expect("every panel queries something");
        assert!(targets
            .iter()
            .all(|t| t["expr"].as_str().is_some_and(|e| !e.is_empty())));
    }
    let referenced = referenced_names(&text);
    assert!(referenced.len() >= 30, "{referenced:?}");
    assert_defined(&dashboard_path, &referenced);

    // The reference table documents every muster metric, and nothing else.
    let readme_path = format!("{examples}/prometheus/README.md");
    let text = std::fs::read_to_string(&readme_path).expect("the metrics reference exists");
    let documented = referenced_names(&text);
    assert_defined(&readme_path, &documented);
    for name in Metrics::new().metric_names() {
        if name.starts_with("muster_") {
            assert!(
                documented.contains(&name),
                "{readme_path} does not document {name}"
            );
        }
    }

    let alerts_path = format!("{examples}/prometheus/muster-alerts.yml");
    let text = std::fs::read_to_string(&alerts_path).expect("the example alerts exist");
    let referenced = referenced_names(&text);
    assert!(referenced.len() >= 5, "{referenced:?}");
    assert_defined(&alerts_path, &referenced);
}

// ---- the endpoint over real sockets ---------------------------------------------------------

fn start(metrics: &Metrics, config: EndpointConfig) -> (SocketAddr, CancellationToken) {
    let endpoint = Endpoint::bind("127.0.0.1:0".parse().unwrap(), metrics.clone(), config).unwrap();
    let addr = endpoint.local_addr();
    let shutdown = CancellationToken::new();
    endpoint.spawn(shutdown.clone());
    (addr, shutdown)
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

/// Reads one response (head plus Content-Length bytes) from `stream`.
async fn read_reply(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Reply> {
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8(buf[..end].to_vec()).unwrap();
            let mut lines = head.split("\r\n");
            let status_line = lines.next().unwrap();
            assert!(status_line.starts_with("HTTP/1.1 "), "{status_line}");
            let status = status_line[9..12].parse().unwrap();
            let headers: BTreeMap<String, String> = lines
                .map(|l| {
                    let (k, v) = l.split_once(": ").unwrap();
                    (k.to_ascii_lowercase(), v.to_owned())
                })
                .collect();
            let len: usize = headers["content-length"].parse().unwrap();
            while buf.len() < end + 4 + len {
                let n = timeout(IO_TIMEOUT, stream.read(&mut chunk))
                    .await
                    .ok()?
                    .ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = String::from_utf8(buf[end + 4..end + 4 + len].to_vec()).unwrap();
            buf.drain(..end + 4 + len);
            return Some(Reply {
                status,
                headers,
                body,
            });
        }
        let n = timeout(IO_TIMEOUT, stream.read(&mut chunk))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn send(addr: SocketAddr, request: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    read_reply(&mut stream, &mut Vec::new()).await.unwrap()
}

/// True when the server closed the connection (EOF) within the I/O timeout.
async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    matches!(
        timeout(IO_TIMEOUT, stream.read_to_end(&mut rest)).await,
        Ok(Ok(_))
    )
}

#[tokio::test]
async fn metrics_are_served_as_prometheus_text() {
    let metrics = Metrics::new();
    let (addr, shutdown) = start(&metrics, EndpointConfig::default());
    let reply = send(
        addr,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers["content-type"], http::METRICS_CONTENT_TYPE);
    assert_eq!(reply.headers["connection"], "close");
    let samples = parse_exposition(&reply.body);
    assert_eq!(value(&samples, "muster_build_info", &[]), Some(1.0));

    // HEAD: the GET's headers, no body, then (HTTP/1.0) a close. hyper answers an HTTP/1.0
    // request in HTTP/1.0.
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"HEAD /metrics HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut raw = Vec::new();
    timeout(IO_TIMEOUT, stream.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    let raw = String::from_utf8(raw).unwrap();
    assert!(raw.starts_with("HTTP/1.0 200 OK\r\n"), "{raw}");
    assert!(raw.ends_with("\r\n\r\n"), "no body after the head: {raw}");
    assert!(!raw.contains("Content-Length: 0\r\n"), "{raw}");

    let reply = send(addr, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n").await;
    let samples = parse_exposition(&reply.body);
    assert!(
        value(
            &samples,
            "muster_http_requests_total",
            &[("handler", "metrics"), ("code", "200")]
        )
        .unwrap()
            >= 2.0
    );
    shutdown.cancel();
}

#[tokio::test]
async fn keep_alive_and_pipelined_requests_share_a_connection() {
    let metrics = Metrics::new();
    let (addr, shutdown) = start(&metrics, EndpointConfig::default());
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut buf = Vec::new();
    for _ in 0..3 {
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let reply = read_reply(&mut stream, &mut buf).await.unwrap();
        assert_eq!((reply.status, reply.body.as_str()), (200, "ok\n"));
        assert_eq!(reply.headers["connection"], "keep-alive");
    }
    // Two requests in one write, the second with a body, then a close.
    stream
        .write_all(
            b"GET /readyz HTTP/1.1\r\n\r\nPOST /checkpoint HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",
        )
        .await
        .unwrap();
    let statuses = [
        read_reply(&mut stream, &mut buf).await.unwrap().status,
        read_reply(&mut stream, &mut buf).await.unwrap().status,
        read_reply(&mut stream, &mut buf).await.unwrap().status,
    ];
    assert_eq!(statuses, [503, 503, 200]);
    assert!(closed_by_server(&mut stream).await);
    shutdown.cancel();
}

#[tokio::test]
async fn bad_requests_get_an_answer_and_a_close_and_the_server_keeps_serving() {
    let metrics = Metrics::new();
    let config = EndpointConfig {
        request_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(500),
        ..EndpointConfig::default()
    };
    let (addr, shutdown) = start(&metrics, config);
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n".to_vec(),
            400,
        ),
        (b"GET /metrics HTTP/3\r\n\r\n".to_vec(), 505),
        (b"BREW /metrics HTTP/1.1\r\n\r\n".to_vec(), 405),
        (b"POST /metrics HTTP/1.1\r\n\r\n".to_vec(), 405),
        (b"GET /checkpoint HTTP/1.1\r\n\r\n".to_vec(), 405),
        (b"GET /nope HTTP/1.1\r\n\r\n".to_vec(), 404),
        (
            b"POST /checkpoint HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
            501,
        ),
        (
            b"POST /checkpoint HTTP/1.1\r\nContent-Length: 100000000\r\n\r\n".to_vec(),
            413,
        ),
        (
            [b"GET /".as_slice(), &[b'a'; 9000], b" HTTP/1.1\r\n\r\n"].concat(),
            431,
        ),
        (
            [b"GET / HTTP/1.1\r\nX: ".as_slice(), &[b'a'; 20000]].concat(),
            431,
        ),
    ];
    for (request, want) in cases {
        let reply = send(addr, &request).await;
        assert_eq!(
            reply.status,
            want,
            "{}",
            String::from_utf8_lossy(&request[..20])
        );
        if want == 405 {
            assert!(reply.headers.contains_key("allow"));
        }
    }

    // Half a request, then silence: 408 after the request timeout, and a close.
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(b"GET /metr").await.unwrap();
    let reply = read_reply(&mut stream, &mut Vec::new()).await.unwrap();
    assert_eq!(reply.status, 408);
    assert!(closed_by_server(&mut stream).await);

    // An idle connection is closed quietly.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    assert!(closed_by_server(&mut idle).await);

    // A peer that vanishes mid-request does not take the server down.
    let mut gone = TcpStream::connect(addr).await.unwrap();
    gone.write_all(b"GET /metrics HTTP/1.1\r\nHost")
        .await
        .unwrap();
    drop(gone);

    let reply = send(addr, b"GET /healthz HTTP/1.1\r\n\r\n").await;
    assert_eq!(reply.status, 200);
    let reply = send(addr, b"GET / HTTP/1.1\r\n\r\n").await;
    assert!(reply.body.contains("/readyz"));
    shutdown.cancel();
}

#[tokio::test]
async fn probes_follow_the_agent_loop() {
    let metrics = Metrics::new();
    let config = EndpointConfig {
        stale_after: Duration::from_millis(300),
        ..EndpointConfig::default()
    };
    let (addr, shutdown) = start(&metrics, config);
    let get = |path: &'static str| async move {
        send(
            addr,
            format!("GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
    };

    assert_eq!(get("/healthz").await.status, 200);
    tokio::time::sleep(Duration::from_millis(450)).await;
    let reply = get("/healthz").await;
    assert_eq!(reply.status, 503);
    assert!(reply.body.contains("silent for"), "{}", reply.body);
    metrics.heartbeat();
    assert_eq!(get("/healthz").await.status, 200);

    // The gang signal: formed and local workers running (also while they checkpoint).
    let reply = get("/gangz").await;
    assert_eq!(reply.status, 503);
    assert_eq!(
        reply.body,
        "gang not running: phase resolving, 0 local workers running\n"
    );
    metrics.set_phase(Phase::Rendezvous);
    assert_eq!(get("/gangz").await.status, 503);
    metrics.set_phase(Phase::Running);
    assert_eq!(
        get("/gangz").await.status,
        503,
        "running but no workers yet"
    );
    metrics.workers().workers_started(2);
    assert_eq!(get("/gangz").await.status, 200);
    metrics.set_phase(Phase::Checkpointing);
    assert_eq!(get("/gangz").await.status, 200);
    metrics.set_phase(Phase::Stopping);
    assert_eq!(get("/gangz").await.status, 503);
    shutdown.cancel();
}

#[tokio::test]
async fn readiness_never_depends_on_the_gang() {
    let metrics = Metrics::new();
    let (addr, shutdown) = start(&metrics, EndpointConfig::default());
    let get = |path: &'static str| async move {
        send(
            addr,
            format!("GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
    };
    let ready = |metrics: &Metrics| value(&scrape(metrics), "muster_agent_ready", &[]);
    let reply = get("/readyz").await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (
            503,
            "not ready: starting (reading the configuration, binding ports)\n"
        )
    );
    assert_eq!(ready(&metrics), Some(0.0));
    metrics.advance_readiness(Readiness::HostingStore);
    let reply = get("/readyz").await;
    assert_eq!(reply.status, 503);
    assert!(reply.body.contains("rendezvous store"), "{}", reply.body);
    metrics.advance_readiness(Readiness::Ready);
    assert_eq!(get("/readyz").await.status, 200);
    assert_eq!(ready(&metrics), Some(1.0));
    // Nothing the gang does takes it back: waiting, restarting, draining.
    for phase in Phase::ALL {
        metrics.set_phase(phase);
        assert_eq!(get("/readyz").await.status, 200, "{phase:?}");
    }
    metrics.workers().workers_stopped();
    metrics.advance_readiness(Readiness::HostingStore);
    assert_eq!(
        get("/readyz").await.status,
        200,
        "readiness only moves forward"
    );
    assert_eq!(
        value(&scrape(&metrics), "muster_gang_running", &[]),
        Some(0.0)
    );
    shutdown.cancel();
}

/// A client socket bound to `source` (another loopback address: another peer to the server).
async fn connect_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::from((source, 0)))
        .expect("bind a 127/8 source address");
    socket.connect(addr).await.unwrap()
}

#[tokio::test]
async fn a_flood_from_one_address_cannot_keep_another_one_out() {
    let metrics = Metrics::new();
    let config = EndpointConfig {
        max_connections: 8,
        max_connections_per_peer: 4,
        ..EndpointConfig::default()
    };
    let (addr, shutdown) = start(&metrics, config);
    // Far more idle connections from 127.0.0.2 than either limit.
    let mut hostile = Vec::new();
    for _ in 0..40 {
        hostile.push(connect_from([127, 0, 0, 2], addr).await);
    }
    // The prober on 127.0.0.1 is answered at once.
    for _ in 0..5 {
        let reply = timeout(
            Duration::from_secs(2),
            send(addr, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"),
        )
        .await
        .expect("answered while 40 idle connections are open");
        assert_eq!(reply.status, 200);
    }
    // The hostile address kept at most its limit: the oldest were closed, the newest are open.
    let mut closed = 0;
    for stream in &mut hostile[..36] {
        let mut byte = [0u8; 1];
        if matches!(
            timeout(Duration::from_secs(2), stream.read(&mut byte)).await,
            Ok(Ok(0) | Err(_))
        ) {
            closed += 1;
        }
    }
    assert_eq!(closed, 36, "every connection but the last 4 was evicted");
    let last = hostile.last_mut().unwrap();
    last.write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_reply(last, &mut Vec::new()).await.unwrap().status, 200);
    let shed = value(
        &scrape(&metrics),
        "muster_http_connections_shed_total",
        &[("limit", "peer")],
    )
    .unwrap();
    assert!(shed >= 36.0, "{shed}");
    shutdown.cancel();
}

#[tokio::test]
async fn a_new_connection_must_send_its_request_soon() {
    let metrics = Metrics::new();
    let config = EndpointConfig {
        first_request_timeout: Duration::from_millis(300),
        ..EndpointConfig::default()
    };
    let (addr, shutdown) = start(&metrics, config);
    let started = std::time::Instant::now();
    let mut silent = TcpStream::connect(addr).await.unwrap();
    assert!(closed_by_server(&mut silent).await);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "closed after the first-request deadline, not the 90 s idle timeout"
    );
    // A slow client that trickles its head gets a 408 at the same deadline.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /hea").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    slow.write_all(b"lt").await.unwrap();
    let reply = read_reply(&mut slow, &mut Vec::new()).await.unwrap();
    assert_eq!(reply.status, 408);
    // Keep-alive: the deadline is for the first request only.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    let mut buf = Vec::new();
    kept.write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_reply(&mut kept, &mut buf).await.unwrap().status, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    kept.write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_reply(&mut kept, &mut buf).await.unwrap().status, 200);
    shutdown.cancel();
}

#[tokio::test]
async fn bare_line_ends_get_400_at_once() {
    let metrics = Metrics::new();
    let (addr, shutdown) = start(&metrics, EndpointConfig::default());
    for request in [
        &b"GET /healthz HTTP/1.1\n\n"[..],
        b"GET /healthz HTTP/1.1\nHost: x\r\n\r\n",
        b"POST /checkpoint HTTP/1.1\r\nContent-Length: 0\n\r\n",
    ] {
        let reply = timeout(Duration::from_secs(2), send(addr, request))
            .await
            .expect("answered at once, not at a timeout");
        assert_eq!(reply.status, 400, "{}", String::from_utf8_lossy(request));
    }
    shutdown.cancel();
}

#[tokio::test]
async fn what_hyper_would_take_or_answer_otherwise_is_refused_as_before() {
    let metrics = Metrics::new();
    let (addr, shutdown) = start(&metrics, EndpointConfig::default());
    let cases: [(&[u8], u16); 7] = [
        (b"GET metrics HTTP/1.1\r\n\r\n", 400),
        (b"OPTIONS * HTTP/1.1\r\n\r\n", 400),
        (b"GET /  HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", 400),
        (
            b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            400,
        ),
        (b"GET /\xff HTTP/1.1\r\n\r\n", 400),
    ];
    for (request, want) in cases {
        let reply = timeout(Duration::from_secs(2), send(addr, request))
            .await
            .expect("answered at once");
        assert_eq!(reply.status, want, "{}", String::from_utf8_lossy(request));
    }
    // A good request, then a bad one in the same write: the first is answered, then the 400.
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\n\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    assert_eq!(read_reply(&mut stream, &mut buf).await.unwrap().status, 200);
    assert_eq!(read_reply(&mut stream, &mut buf).await.unwrap().status, 400);
    assert!(closed_by_server(&mut stream).await);
    // Answers hyper gives itself are counted like the others.
    let samples = scrape(&metrics);
    let count = |code: &str| {
        value(
            &samples,
            "muster_http_requests_total",
            &[("handler", "other"), ("code", code)],
        )
        .unwrap_or(0.0)
    };
    assert_eq!((count("400"), count("505")), (7.0, 1.0));
    shutdown.cancel();
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_a_quiet_keep_alive_connection_is_closed() {
    let metrics = Metrics::new();
    let config = EndpointConfig {
        request_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(400),
        ..EndpointConfig::default()
    };
    let (addr, shutdown) = start(&metrics, config);
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"POST /checkpoint HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        .await
        .unwrap();
    let reply = read_reply(&mut stream, &mut Vec::new()).await.unwrap();
    assert_eq!(reply.status, 408);
    assert_eq!(reply.headers["connection"], "close");
    assert!(closed_by_server(&mut stream).await);

    // After a response, the keep-alive connection stays open for the idle timeout, then closes.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    let mut buf = Vec::new();
    kept.write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_reply(&mut kept, &mut buf).await.unwrap().status, 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    kept.write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_reply(&mut kept, &mut buf).await.unwrap().status, 200);
    let started = std::time::Instant::now();
    assert!(closed_by_server(&mut kept).await);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    shutdown.cancel();
}

#[tokio::test]
async fn loopback_may_checkpoint_with_or_without_a_token() {
    let metrics = Metrics::new();
    let token_file = std::env::temp_dir().join(format!("muster-tok-{}", std::process::id()));
    std::fs::write(&token_file, "letmein\n").unwrap();
    let requests = RequestSlot::default();
    let config = EndpointConfig {
        checkpoint_token: Some(CheckpointToken::from_file(&token_file).unwrap()),
        checkpoint_requests: requests.clone(),
        ..EndpointConfig::default()
    };
    std::fs::remove_file(&token_file).unwrap();
    let (addr, shutdown) = start(&metrics, config);
    let mut consumer = requests.register();
    let reply = send(
        addr,
        b"POST /checkpoint HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    )
    .await;
    assert_eq!(reply.status, 202);
    assert!(timeout(IO_TIMEOUT, consumer.recv())
        .await
        .unwrap()
        .is_some());
    let samples = scrape(&metrics);
    for reason in ["forbidden", "unauthorized"] {
        assert_eq!(
            value(
                &samples,
                "muster_checkpoint_requests_rejected_total",
                &[("reason", reason)]
            ),
            Some(0.0)
        );
    }
    shutdown.cancel();
}

#[tokio::test]
async fn checkpoint_requests_reach_the_registered_consumer() {
    let metrics = Metrics::new();
    let requests = RequestSlot::default();
    let config = EndpointConfig {
        checkpoint_requests: requests.clone(),
        ..EndpointConfig::default()
    };
    let (addr, shutdown) = start(&metrics, config);
    let post = || {
        send(
            addr,
            b"POST /checkpoint HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        )
    };

    let reply = post().await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (503, "checkpoint barrier not available\n")
    );

    let mut consumer = requests.register();
    let reply = post().await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (202, "checkpoint requested\n")
    );
    let reply = post().await;
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (202, "checkpoint already requested\n")
    );
    let request = timeout(IO_TIMEOUT, consumer.recv()).await.unwrap().unwrap();
    assert_eq!(request.trigger, CheckpointTrigger::Http);
    assert!(consumer.try_recv().is_none());
    let samples = scrape(&metrics);
    assert_eq!(
        value(
            &samples,
            "muster_checkpoint_requests_total",
            &[("trigger", "http")]
        ),
        Some(2.0)
    );

    drop(consumer);
    assert_eq!(post().await.status, 503, "the consumer went away");
    shutdown.cancel();
}

#[tokio::test]
async fn shutdown_stops_serving_and_the_port_can_be_rebound() {
    let metrics = Metrics::new();
    let endpoint = Endpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        metrics.clone(),
        EndpointConfig::default(),
    )
    .unwrap();
    let addr = endpoint.local_addr();
    let shutdown = CancellationToken::new();
    let task = endpoint.spawn(shutdown.clone());
    let mut keep = TcpStream::connect(addr).await.unwrap();
    keep.write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(
        read_reply(&mut keep, &mut Vec::new()).await.unwrap().status,
        200
    );

    // A second endpoint on the same port is refused with a clear error.
    let err = Endpoint::bind(addr, metrics.clone(), EndpointConfig::default()).unwrap_err();
    assert!(err.to_string().contains(&addr.to_string()), "{err}");

    shutdown.cancel();
    timeout(IO_TIMEOUT, task).await.unwrap().unwrap();
    assert!(
        closed_by_server(&mut keep).await,
        "open connections end on shutdown"
    );
    Endpoint::bind(addr, metrics, EndpointConfig::default()).expect("the port is free again");
}

#[tokio::test]
async fn the_unspecified_address_listens_on_loopback_too() {
    let metrics = Metrics::new();
    let endpoint = Endpoint::bind(
        "0.0.0.0:0".parse().unwrap(),
        metrics,
        EndpointConfig::default(),
    )
    .unwrap();
    let port = endpoint.local_addr().port();
    let shutdown = CancellationToken::new();
    endpoint.spawn(shutdown.clone());
    let reply = send(
        SocketAddr::from(([127, 0, 0, 1], port)),
        b"GET /healthz HTTP/1.1\r\n\r\n",
    )
    .await;
    assert_eq!(reply.status, 200);
    shutdown.cancel();
}

#[test]
fn gathering_is_fast() {
    let metrics = Metrics::new();
    metrics.workers().workers_started(8);
    for rank in 0..8 {
        metrics.workers().worker_step(rank, 100);
        metrics
            .preflight()
            .gpu_nvlink_active_links(rank, "GPU-x", 18);
        for check in ["ecc", "nvlink", "thermal", "pcie", "fabric"] {
            metrics
                .preflight()
                .gpu_check(Some(rank), "GPU-x", check, true);
        }
    }
    let mut times: Vec<Duration> = (0..200)
        .map(|_| {
            let start = std::time::Instant::now();
            let body = metrics.encode();
            let took = start.elapsed();
            assert!(body.len() > 1000);
            took
        })
        .collect();
    times.sort();
    let median = times[times.len() / 2];
    // The < 1 ms promise is for the release binary (checked against the running agent in
    // tests/python/test_metrics.py); unoptimised test builds get headroom.
    let limit = if cfg!(debug_assertions) {
        Duration::from_millis(20)
    } else {
        Duration::from_millis(1)
    };
    assert!(median < limit, "median gather+encode {median:?}");
}

#[tokio::test]
async fn a_real_store_server_is_observed_at_scrape_time() {
    use rendezvous::store::client::Client;
    use rendezvous::store::server::{Config, Server};

    let server = Server::bind("127.0.0.1:0".parse().unwrap(), Config::default())
        .await
        .unwrap();
    let addr = server.local_addr();
    let metrics = Metrics::new();
    metrics.attach_store(StoreRole::Rendezvous, server.stats());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(server.run(shutdown.clone()));

    let mut client = timeout(IO_TIMEOUT, Client::connect(addr, IO_TIMEOUT))
        .await
        .unwrap()
        .unwrap();
    client.set(b"k", b"v").await.unwrap();
    client.set(b"k2", b"v").await.unwrap();
    assert_eq!(client.get(b"k").await.unwrap(), b"v");

    let samples = scrape(&metrics);
    let v = |name: &str, labels: &[(&str, &str)]| value(&samples, name, labels);
    let store = ("store", "rendezvous");
    assert_eq!(v("muster_store_connections", &[store]), Some(1.0));
    assert_eq!(
        v("muster_store_connections_accepted_total", &[store]),
        Some(1.0)
    );
    assert_eq!(
        v(
            "muster_store_operations_total",
            &[store, ("command", "SET")]
        ),
        Some(2.0)
    );
    assert_eq!(
        v(
            "muster_store_operations_total",
            &[store, ("command", "GET")]
        ),
        Some(1.0)
    );
    assert_eq!(
        v(
            "muster_store_operations_total",
            &[store, ("command", "BARRIER")]
        ),
        Some(0.0),
        "every command has a series from the start"
    );
    assert_eq!(v("muster_store_keys", &[store]), Some(2.0));
    assert!(v("muster_store_received_bytes_total", &[store]).unwrap() > 0.0);
    assert!(v("muster_store_sent_bytes_total", &[store]).unwrap() > 0.0);

    drop(client);
    shutdown.cancel();
    timeout(IO_TIMEOUT, task).await.unwrap().unwrap().unwrap();
}

#[test]
fn the_endpoint_thread_serves_while_the_caller_is_blocked() {
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let serving = serve_in_thread(
        "127.0.0.1:0".parse().unwrap(),
        metrics.clone(),
        EndpointConfig::default(),
        &shutdown,
    )
    .unwrap();
    let addr = serving.local_addr();
    // No runtime on this thread at all: the endpoint has its own.
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    std::io::Write::write_all(&mut stream, b"GET /readyz HTTP/1.0\r\n\r\n").unwrap();
    let mut reply = String::new();
    std::io::Read::read_to_string(&mut stream, &mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.0 503 "), "{reply}");

    let taken = serve_in_thread(addr, metrics, EndpointConfig::default(), &shutdown).unwrap_err();
    assert!(matches!(taken, ServeError::Bind { .. }), "{taken}");

    shutdown.cancel();
    serving.stop();
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "closed after stop"
    );
}

#[tokio::test]
async fn gangz_and_a_gauge_show_the_spares_node_0_answered() {
    let metrics = Metrics::new();
    let (addr, shutdown) = start(&metrics, EndpointConfig::default());
    let get = |path: &'static str| async move {
        send(
            addr,
            format!("GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
    };
    let spares = rendezvous::rdzv::driver::SpareHosts::default();
    metrics.attach_spare_hosts(spares.clone());
    metrics.set_phase(Phase::Running);
    metrics.workers().workers_started(1);
    assert_eq!(get("/gangz").await.body, "gang running\n");
    assert_eq!(
        value(&scrape(&metrics), "muster_gang_spares", &[]),
        Some(0.0)
    );
    spares
        .lock()
        .unwrap()
        .extend(["pod-3".to_owned(), "pod-4".to_owned()]);
    let reply = get("/gangz").await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.body,
        "gang running; 2 spare(s) waiting: pod-3, pod-4\n"
    );
    assert_eq!(
        value(&scrape(&metrics), "muster_gang_spares", &[]),
        Some(2.0)
    );
    shutdown.cancel();
}

#[tokio::test]
async fn gangz_and_gauges_show_what_the_standbys_cost() {
    let metrics = Metrics::new();
    let (addr, shutdown) = start(&metrics, EndpointConfig::default());
    let get = |path: &'static str| async move {
        send(
            addr,
            format!("GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
    };
    metrics.set_phase(Phase::Running);
    metrics.workers().workers_started(2);
    let text = scrape(&metrics);
    for state in ["importing", "ready"] {
        assert_eq!(
            value(&text, "muster_standbys", &[("state", state)]),
            Some(0.0),
            "{state} at 0 from the start"
        );
    }
    assert_eq!(get("/gangz").await.body, "gang running\n");

    metrics
        .restarts()
        .standbys(&crate::launch::standby::Standbys {
            importing: 1,
            ready: 1,
            resident_bytes: 700 << 20,
            cpu: Duration::from_millis(3_500),
        });
    let text = scrape(&metrics);
    assert_eq!(
        value(&text, "muster_standbys", &[("state", "ready")]),
        Some(1.0)
    );
    assert_eq!(
        value(&text, "muster_standbys", &[("state", "importing")]),
        Some(1.0)
    );
    assert_eq!(
        value(&text, "muster_standby_resident_bytes", &[]),
        Some((700u64 << 20) as f64)
    );
    assert_eq!(value(&text, "muster_standby_cpu_seconds", &[]), Some(3.5));
    assert_eq!(
        get("/gangz").await.body,
        "gang running\n1 warm standby(s) ready (700 MiB resident), 1 importing\n"
    );

    // Taken at the restart: the line goes, the CPU they cost stays counted.
    metrics
        .restarts()
        .standbys(&crate::launch::standby::Standbys {
            cpu: Duration::from_millis(3_500),
            ..Default::default()
        });
    assert_eq!(get("/gangz").await.body, "gang running\n");
    assert_eq!(
        value(&scrape(&metrics), "muster_standby_cpu_seconds", &[]),
        Some(3.5)
    );
    shutdown.cancel();
}

#[tokio::test]
async fn gangz_and_gauges_show_the_committed_snapshot_and_what_it_cost() {
    use crate::snapshot::Meter;
    let metrics = Metrics::new();
    let (addr, shutdown) = start(&metrics, EndpointConfig::default());
    let get = |path: &'static str| async move {
        send(
            addr,
            format!("GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
    };
    metrics.set_phase(Phase::Running);
    metrics.workers().workers_started(2);
    let text = scrape(&metrics);
    assert_eq!(
        value(&text, "muster_snapshot_committed_step", &[]),
        Some(0.0)
    );
    for why in super::snapshots::REFUSALS {
        assert_eq!(
            value(&text, "muster_snapshot_refused_total", &[("why", why)]),
            Some(0.0),
            "{why} at 0 from the start"
        );
    }
    assert_eq!(get("/gangz").await.body, "gang running\n");

    let meter = metrics.snapshot_meter();
    meter.held(0, 160 << 20, 0.04, 160 << 20);
    meter.held(1, 160 << 20, 0.06, 320 << 20);
    meter.refused("busy");
    meter.committed(10, 320 << 20);
    meter.replicated(10, 0.25);
    meter.persisted(10, 1.5);
    let text = scrape(&metrics);
    assert_eq!(
        value(&text, "muster_snapshot_persisted_step", &[]),
        Some(10.0)
    );
    assert_eq!(
        value(&text, "muster_snapshot_persist_seconds", &[]),
        Some(1.5)
    );
    assert_eq!(
        value(&text, "muster_snapshot_committed_step", &[]),
        Some(10.0)
    );
    assert_eq!(
        value(&text, "muster_snapshot_replicated_step", &[]),
        Some(10.0)
    );
    assert_eq!(
        value(&text, "muster_snapshot_replication_seconds", &[]),
        Some(0.25)
    );
    assert_eq!(
        value(&text, "muster_snapshot_part_bytes", &[("rank", "1")]),
        Some((160u64 << 20) as f64)
    );
    assert_eq!(
        value(&text, "muster_snapshot_held_bytes", &[]),
        Some((320u64 << 20) as f64)
    );
    assert_eq!(
        value(&text, "muster_snapshot_blocking_seconds_count", &[]),
        Some(2.0)
    );
    assert_eq!(
        value(&text, "muster_snapshot_refused_total", &[("why", "busy")]),
        Some(1.0)
    );
    assert_eq!(
        get("/gangz").await.body,
        "gang running\nsnapshots: step 10 committed on every node, 320 MiB held on this node\n"
    );

    // A restart restores step 15, which every node held though its commit was cut short.
    meter.settled(Some(15), 320 << 20);
    let text = scrape(&metrics);
    assert_eq!(
        value(&text, "muster_snapshot_restored_step", &[]),
        Some(15.0)
    );
    assert_eq!(
        value(&text, "muster_snapshot_committed_step", &[]),
        Some(15.0)
    );
    shutdown.cancel();
}
