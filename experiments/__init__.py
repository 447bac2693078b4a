"""Launchers, configs, sweeps and notebooks. Imports everything; imported by nothing."""
