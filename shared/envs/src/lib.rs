//! Classic-control environments.
