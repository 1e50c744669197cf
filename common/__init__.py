"""Shared pieces every template needs: config, accelerator, data, checkpoints, tracking."""
