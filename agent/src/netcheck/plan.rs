//! Which node measures which, per round: pure functions of the gang size and round 1's results.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::verdict::{Classifier, Sample};

/// `from` connects to `to` and measures (group ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Pair {
    pub from: u32,
    pub to: u32,
}

/// Round 1: each node measures the next one around the ring, all at once; every node sends one
/// stream and receives one. Two nodes measure each other both ways; one node measures nothing.
pub fn ring(n: u32) -> Vec<Pair> {
    if n < 2 {
        return Vec::new();
    }
    (0..n)
        .map(|from| Pair {
            from,
            to: (from + 1) % n,
        })
        .collect()
}

/// Round 2, from round 1's `samples`: every suspect (all its measurements slow) sends to a node
/// that was fast with someone, preferring one it has not measured with and spreading the
/// suspects over those nodes; every slow measurement is made again, to tell a bad link from a
/// passing hiccup (and a suspect that was only unlucky from a bad node). Empty when nothing was
/// slow.
pub fn second_round(n: u32, samples: &[Sample], c: &Classifier) -> Vec<Pair> {
    let suspects = c.all_slow(n, samples);
    let healthy: Vec<u32> = (0..n)
        .filter(|r| !suspects.contains(r))
        .filter(|r| {
            samples
                .iter()
                .any(|s| (s.from == *r || s.to == *r) && c.slow(s).is_none())
        })
        .collect();
    let mut pairs = BTreeSet::new();
    if !healthy.is_empty() {
        for (i, &suspect) in suspects.iter().enumerate() {
            let measured = |h: u32| {
                samples
                    .iter()
                    .any(|s| (s.from == suspect && s.to == h) || (s.from == h && s.to == suspect))
            };
            // Start the search at a different healthy node for each suspect.
            let pick = (0..healthy.len())
                .map(|k| healthy[(i + k) % healthy.len()])
                .find(|&h| !measured(h))
                .or_else(|| {
                    // Only partners it already measured with: the direction not yet measured.
                    (0..healthy.len())
                        .map(|k| healthy[(i + k) % healthy.len()])
                        .find(|&h| !samples.iter().any(|s| s.from == suspect && s.to == h))
                });
            if let Some(to) = pick {
                pairs.insert(Pair { from: suspect, to });
            }
        }
    }
    for s in samples {
        if c.slow(s).is_some() {
            pairs.insert(Pair {
                from: s.from,
                to: s.to,
            });
        }
    }
    pairs.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netcheck::Thresholds;

    fn s(from: u32, to: u32, mbps: u64) -> Sample {
        Sample {
            from,
            to,
            round: 1,
            rtt_us: Some(50),
            bytes: mbps * 1_000_000,
            micros: 1_000_000,
            error: None,
            cpu_wait_permille: None,
        }
    }

    #[test]
    fn the_ring_covers_every_node_once_each_way() {
        assert!(ring(1).is_empty());
        assert_eq!(
            ring(2),
            vec![Pair { from: 0, to: 1 }, Pair { from: 1, to: 0 }]
        );
        let r = ring(8);
        assert_eq!(r.len(), 8);
        for node in 0..8 {
            assert_eq!(r.iter().filter(|p| p.from == node).count(), 1);
            assert_eq!(r.iter().filter(|p| p.to == node).count(), 1);
        }
    }

    #[test]
    fn a_suspect_meets_a_fast_node_it_has_not_measured_with() {
        let samples = vec![
            s(0, 1, 900),
            s(1, 2, 1),
            s(2, 3, 1),
            s(3, 4, 900),
            s(4, 0, 900),
        ];
        let c = Classifier::new(5, &samples, &Thresholds::default());
        let plan = second_round(5, &samples, &c);
        // Node 2 is the suspect; 1 and 3 are its ring neighbours, so it meets 0 or 4; its two
        // slow measurements are made again.
        assert_eq!(plan.len(), 3, "{plan:?}");
        assert!(plan.contains(&Pair { from: 1, to: 2 }) && plan.contains(&Pair { from: 2, to: 3 }));
        let extra: Vec<&Pair> = plan.iter().filter(|p| p.from == 2 && p.to != 3).collect();
        assert!(
            matches!(extra[..], [p] if [0, 4].contains(&p.to)),
            "{plan:?}"
        );
    }

    #[test]
    fn a_slow_link_is_measured_again_and_a_clean_round_needs_no_second() {
        let samples = vec![s(0, 1, 900), s(1, 2, 3), s(2, 3, 900), s(3, 0, 900)];
        let c = Classifier::new(4, &samples, &Thresholds::default());
        assert_eq!(second_round(4, &samples, &c), vec![Pair { from: 1, to: 2 }]);
        let clean: Vec<Sample> = ring(6).iter().map(|p| s(p.from, p.to, 900)).collect();
        let c = Classifier::new(6, &clean, &Thresholds::default());
        assert!(second_round(6, &clean, &c).is_empty());
    }

    #[test]
    fn in_three_nodes_a_suspect_measures_the_other_direction() {
        let samples = vec![s(0, 1, 900), s(1, 2, 1), s(2, 0, 1)];
        let c = Classifier::new(3, &samples, &Thresholds::default());
        let plan = second_round(3, &samples, &c);
        assert_eq!(
            plan,
            vec![
                Pair { from: 1, to: 2 },
                Pair { from: 2, to: 0 },
                Pair { from: 2, to: 1 }
            ]
        );
    }
}
