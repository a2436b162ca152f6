//! Summaries of repeated measurements: median, min and max over rounds, and nearest-rank
//! percentiles of latency samples.

use serde::Serialize;

/// One measure over every round.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// Every round's value, in round order.
    pub values: Vec<f64>,
}

impl Summary {
    /// `None` for no values (a measure that never ran).
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut sorted: Vec<f64> = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let (min, max) = (*sorted.first()?, *sorted.last()?);
        let mid = sorted.len() / 2;
        let median = if sorted.len() % 2 == 1 { sorted[mid] } else { (sorted[mid - 1] + sorted[mid]) / 2.0 };
        Some(Self { median, min, max, values: values.to_vec() })
    }
}

/// The nearest-rank `p`-th percentile (0 < p ≤ 100) of `sorted`, which must be sorted.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_even_count_is_the_mean_of_the_middle_two() {
        let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]).expect("values");
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 4.0));
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 1.0), Some(7.0));
    }
}
