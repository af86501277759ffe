//! Accelerate-exact data sharding: which items each rank sees at each step, and
//! `gather_for_metrics`.
