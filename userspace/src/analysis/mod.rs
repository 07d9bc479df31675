//! What a window means: its metrics (the difference of two snapshots), where the futex
//! calls came from, the verdict (classifier), the model's prediction and what the
//! watch measurably cost the target (measured_cost).

pub mod classifier;
pub mod futex;
pub mod measured_cost;
pub mod metrics;
pub mod model;
