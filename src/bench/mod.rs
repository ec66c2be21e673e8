//! Virtual-time fleet benchmark (not built yet).
