//! evaluator
