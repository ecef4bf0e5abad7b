//! prometheus_client's multiprocess merge (its `MultiProcessCollector`), in Rust, per rank.
//!
//! Within one directory (a rank, with any child processes it started) the rules are
//! prometheus_client's:
//! - counters and summaries (`_count`, `_sum`): summed over processes;
//! - histograms: bucket counts summed per `le` and made cumulative, `_count` the total, `_sum`
//!   summed;
//! - gauges by their mode: `min`, `max`, `sum` over processes, `mostrecent` the value with the
//!   newest timestamp, `all` one series per process. The `live*` variants are the same over
//!   processes still running: the caller decides which pids are alive (files of dead pids are
//!   skipped, the effect of prometheus_client's `mark_process_dead` without deleting anything).
//!
//! Counters of exited processes keep counting, so a sum never goes backwards while the
//! directory lives (one attempt).
//!
//! Then each directory's series get the directory's own labels (`rank`, `local_rank`); a script's
//! label of the same name is kept as `exported_<name>`, as Prometheus does on a clash. In mode
//! `all`, a series written by one process of a rank is that rank's (no `pid` label: the rank
//! already names it, and a restart does not change the series); only a series written by several
//! processes of one rank keeps a `pid` label per process. A directory with no labels of its own
//! (the user's own `PROMETHEUS_MULTIPROC_DIR`) keeps `pid` always, exactly as
//! `MultiProcessCollector` serves it.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use prometheus::proto::{self, MetricFamily, MetricType};

use super::file::{Entry, FileName, GaugeMode, Kind};

/// One directory's files, read.
#[derive(Debug, Clone)]
pub struct Source {
    /// Labels added to every series of this directory (`rank`, `local_rank`), in order.
    pub labels: Vec<(String, String)>,
    pub files: Vec<(FileName, Vec<Entry>)>,
}

/// Something the merge left out, to be reported once.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Skipped {
    /// A script family whose name (or one of its sample names) is muster's own.
    Collision(String),
    /// The same family name written with two types; the first type seen is served.
    TypeConflict(String),
    /// A metric or label name the exposition format does not allow.
    InvalidName(String),
}

type Labels = Vec<(String, String)>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FamilyType {
    Counter,
    Gauge,
    Histogram,
    Summary,
}

#[derive(Debug, Default)]
struct HistogramSeries {
    /// Per-bucket (not yet cumulative) counts by upper bound; `+Inf` included.
    buckets: BTreeMap<Bound, f64>,
    sum: f64,
}

/// An `le` bound ordered as a number (`f64` has no `Ord`; NaN is never a bound).
#[derive(Debug, Clone, Copy)]
struct Bound(f64);
impl PartialEq for Bound {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Bound {}
impl PartialOrd for Bound {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bound {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug)]
enum Series {
    Value(f64),
    Histogram(HistogramSeries),
    Summary { count: f64, sum: f64 },
}

#[derive(Debug)]
struct Family {
    kind: FamilyType,
    help: String,
    series: BTreeMap<Labels, Series>,
}

/// Merges `sources` into metric families, leaving out families whose names `reserved` holds and
/// files of dead processes in `live*` modes. Returns the families (sorted by name, none empty)
/// and what was left out.
pub fn merge<S: std::hash::BuildHasher>(
    sources: &[Source],
    reserved: &HashSet<String, S>,
    is_alive: &dyn Fn(u32) -> bool,
) -> (Vec<MetricFamily>, BTreeSet<Skipped>) {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    let mut skipped = BTreeSet::new();
    for source in sources {
        for (name, family) in merge_directory(source, is_alive, &mut skipped) {
            match families.get_mut(&name) {
                Some(existing) if existing.kind != family.kind => {
                    skipped.insert(Skipped::TypeConflict(name));
                }
                Some(existing) => existing.series.extend(family.series),
                None => {
                    families.insert(name, family);
                }
            }
        }
    }
    let mut out = Vec::with_capacity(families.len());
    for (name, family) in families {
        if exposed_names(&name, family.kind)
            .iter()
            .any(|n| reserved.contains(n))
        {
            skipped.insert(Skipped::Collision(name));
            continue;
        }
        if let Some(mf) = to_proto(name, family) {
            out.push(mf);
        }
    }
    (out, skipped)
}

/// The names a family's samples appear under.
fn exposed_names(name: &str, kind: FamilyType) -> Vec<String> {
    match kind {
        FamilyType::Counter | FamilyType::Gauge => vec![name.to_owned()],
        FamilyType::Histogram => ["", "_bucket", "_count", "_sum"]
            .iter()
            .map(|s| format!("{name}{s}"))
            .collect(),
        FamilyType::Summary => ["", "_count", "_sum"]
            .iter()
            .map(|s| format!("{name}{s}"))
            .collect(),
    }
}

/// A gauge value of one process, before the mode's rule picks.
struct GaugeValue {
    pid: u32,
    value: f64,
    timestamp: f64,
}

fn merge_directory(
    source: &Source,
    is_alive: &dyn Fn(u32) -> bool,
    skipped: &mut BTreeSet<Skipped>,
) -> BTreeMap<String, Family> {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    let mut gauges: BTreeMap<(String, Labels), (GaugeMode, Vec<GaugeValue>)> = BTreeMap::new();
    let mut dead: HashSet<u32> = HashSet::new();
    for (file, entries) in &source.files {
        if let Kind::Gauge(_, true) = file.kind {
            if dead.contains(&file.pid) || !is_alive(file.pid) {
                dead.insert(file.pid);
                continue;
            }
        }
        for entry in entries {
            if !valid_metric_name(&entry.key.sample)
                || !entry.key.labels.keys().all(|l| valid_label_name(l))
            {
                skipped.insert(Skipped::InvalidName(entry.key.sample.clone()));
                continue;
            }
            let labels: Labels = entry
                .key
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            match file.kind {
                Kind::Counter => {
                    let family =
                        family(&mut families, &entry.key.sample, FamilyType::Counter, entry);
                    add_value(family, labels, entry.value, skipped, &entry.key.sample);
                }
                Kind::Gauge(mode, _) => {
                    gauges
                        .entry((entry.key.metric.clone(), labels))
                        .or_insert_with(|| (mode, Vec::new()))
                        .1
                        .push(GaugeValue {
                            pid: file.pid,
                            value: entry.value,
                            timestamp: entry.timestamp,
                        });
                    family(&mut families, &entry.key.metric, FamilyType::Gauge, entry);
                }
                Kind::Summary => {
                    let family =
                        family(&mut families, &entry.key.metric, FamilyType::Summary, entry);
                    let Some(suffix) = entry.key.sample.strip_prefix(entry.key.metric.as_str())
                    else {
                        continue;
                    };
                    let series = family.series.entry(labels).or_insert(Series::Summary {
                        count: 0.0,
                        sum: 0.0,
                    });
                    if let Series::Summary { count, sum } = series {
                        match suffix {
                            "_count" => *count += entry.value,
                            "_sum" => *sum += entry.value,
                            _ => {}
                        }
                    }
                }
                Kind::Histogram => {
                    let family = family(
                        &mut families,
                        &entry.key.metric,
                        FamilyType::Histogram,
                        entry,
                    );
                    let mut labels = labels;
                    let le = labels
                        .iter()
                        .position(|(k, _)| k == "le")
                        .map(|i| labels.remove(i).1);
                    let series = family
                        .series
                        .entry(labels)
                        .or_insert_with(|| Series::Histogram(HistogramSeries::default()));
                    let Series::Histogram(h) = series else {
                        continue;
                    };
                    match le {
                        Some(le) => match parse_bound(&le) {
                            Some(bound) => *h.buckets.entry(bound).or_insert(0.0) += entry.value,
                            None => {
                                skipped.insert(Skipped::InvalidName(format!(
                                    "{}{{le={le:?}}}",
                                    entry.key.sample
                                )));
                            }
                        },
                        None if entry.key.sample.ends_with("_sum") => h.sum += entry.value,
                        None => {}
                    }
                }
            }
        }
    }
    for ((metric, labels), (mode, values)) in gauges {
        let Some(family) = families.get_mut(&metric) else {
            continue;
        };
        if family.kind != FamilyType::Gauge {
            skipped.insert(Skipped::TypeConflict(metric));
            continue;
        }
        for (labels, value) in gauge_series(mode, labels, &values, source.labels.is_empty()) {
            family.series.insert(labels, Series::Value(value));
        }
    }
    // The directory's own labels last, so they win over a script's label of the same name.
    families
        .into_iter()
        .map(|(name, mut family)| {
            if !source.labels.is_empty() {
                family.series = std::mem::take(&mut family.series)
                    .into_iter()
                    .map(|(labels, series)| (with_labels(labels, &source.labels), series))
                    .collect();
            }
            (name, family)
        })
        .filter(|(_, family)| !family.series.is_empty())
        .collect()
}

/// The family `name`, created with `kind` and the entry's help if new; a family already of
/// another kind is returned as it is (the caller's sample then lands in a mismatched series and
/// is dropped, and the conflict is reported when the directories are combined).
fn family<'a>(
    families: &'a mut BTreeMap<String, Family>,
    name: &str,
    kind: FamilyType,
    entry: &Entry,
) -> &'a mut Family {
    families.entry(name.to_owned()).or_insert_with(|| Family {
        kind,
        help: entry.key.help.clone(),
        series: BTreeMap::new(),
    })
}

fn add_value(
    family: &mut Family,
    labels: Labels,
    value: f64,
    skipped: &mut BTreeSet<Skipped>,
    name: &str,
) {
    if family.kind != FamilyType::Counter {
        skipped.insert(Skipped::TypeConflict(name.to_owned()));
        return;
    }
    if let Series::Value(v) = family.series.entry(labels).or_insert(Series::Value(0.0)) {
        *v += value;
    }
}

/// The series a gauge mode makes of one label set's per-process values.
fn gauge_series(
    mode: GaugeMode,
    labels: Labels,
    values: &[GaugeValue],
    always_pid: bool,
) -> Vec<(Labels, f64)> {
    let pick = |better: &dyn Fn(&GaugeValue, &GaugeValue) -> bool| {
        values
            .iter()
            .reduce(|best, v| if better(v, best) { v } else { best })
            .map(|v| v.value)
    };
    let value = match mode {
        GaugeMode::All => {
            if values.len() == 1 && !always_pid {
                return vec![(labels, values[0].value)];
            }
            return values
                .iter()
                .map(|v| {
                    let mut labels = labels.clone();
                    labels.push(("pid".to_owned(), v.pid.to_string()));
                    labels.sort();
                    (labels, v.value)
                })
                .collect();
        }
        GaugeMode::Min => pick(&|v, best| v.value < best.value),
        GaugeMode::Max => pick(&|v, best| v.value > best.value),
        GaugeMode::Sum => Some(values.iter().map(|v| v.value).sum()),
        GaugeMode::MostRecent => pick(&|v, best| v.timestamp > best.timestamp),
    };
    value.map(|v| vec![(labels, v)]).unwrap_or_default()
}

/// `labels` with `own` added; a label of the same name as one of `own` becomes
/// `exported_<name>`.
fn with_labels(labels: Labels, own: &[(String, String)]) -> Labels {
    let mut out: Labels = labels
        .into_iter()
        .map(|(k, v)| {
            if own.iter().any(|(o, _)| *o == k) {
                (format!("exported_{k}"), v)
            } else {
                (k, v)
            }
        })
        .collect();
    out.extend(own.iter().cloned());
    out
}

fn parse_bound(le: &str) -> Option<Bound> {
    let value = match le {
        "+Inf" | "Inf" => f64::INFINITY,
        other => other.parse::<f64>().ok()?,
    };
    (!value.is_nan()).then_some(Bound(value))
}

fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn label_pairs(labels: Labels) -> Vec<proto::LabelPair> {
    labels
        .into_iter()
        .map(|(name, value)| {
            let mut pair = proto::LabelPair::default();
            pair.set_name(name);
            pair.set_value(value);
            pair
        })
        .collect()
}

/// Histogram counts are whole numbers of observations kept as `f64`.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn count(value: f64) -> u64 {
    value.max(0.0).round() as u64
}

fn to_proto(name: String, family: Family) -> Option<MetricFamily> {
    let mut mf = MetricFamily::default();
    mf.set_field_type(match family.kind {
        FamilyType::Counter => MetricType::COUNTER,
        FamilyType::Gauge => MetricType::GAUGE,
        FamilyType::Histogram => MetricType::HISTOGRAM,
        FamilyType::Summary => MetricType::SUMMARY,
    });
    let mut metrics = Vec::with_capacity(family.series.len());
    for (labels, series) in family.series {
        let mut m = proto::Metric::from_label(label_pairs(labels));
        match (family.kind, series) {
            (FamilyType::Counter, Series::Value(v)) => {
                let mut c = proto::Counter::default();
                c.set_value(v);
                m.set_counter(c);
            }
            (FamilyType::Gauge, Series::Value(v)) => {
                let mut g = proto::Gauge::default();
                g.set_value(v);
                m.set_gauge(g);
            }
            (FamilyType::Summary, Series::Summary { count: n, sum }) => {
                let mut s = proto::Summary::default();
                s.set_sample_count(count(n));
                s.set_sample_sum(sum);
                m.set_summary(s);
            }
            (FamilyType::Histogram, Series::Histogram(h)) => {
                let mut acc = 0.0;
                let mut buckets = Vec::with_capacity(h.buckets.len());
                for (bound, n) in h.buckets {
                    acc += n;
                    // The encoder writes `+Inf` itself, spelled the way Prometheus expects.
                    if bound.0.is_infinite() {
                        continue;
                    }
                    let mut b = proto::Bucket::default();
                    b.set_upper_bound(bound.0);
                    b.set_cumulative_count(count(acc));
                    buckets.push(b);
                }
                let mut hist = proto::Histogram::default();
                hist.set_bucket(buckets);
                hist.set_sample_count(count(acc));
                hist.set_sample_sum(h.sum);
                m.set_histogram(hist);
            }
            _ => continue,
        }
        metrics.push(m);
    }
    if metrics.is_empty() {
        return None;
    }
    mf.set_name(name);
    mf.set_help(family.help);
    mf.set_metric(metrics);
    Some(mf)
}
