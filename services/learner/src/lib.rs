//! learner
