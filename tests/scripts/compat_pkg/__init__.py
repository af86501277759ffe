"""Package for tests/tests/launch_compat.rs's `-m compat_pkg.dump` rows."""
