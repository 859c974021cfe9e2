//! inference-server
