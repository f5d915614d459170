"""moekit's benchmark harness and GPU checks (not part of the package)"""
