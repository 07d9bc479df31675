//! What a window means: its metrics (the difference of two snapshots), where the futex
//! calls came from, the verdict (classifier) and the model's prediction.

pub mod classifier;
pub mod futex;
pub mod metrics;
pub mod model;
