"""What operators read: the exporter, the audit trail, sd_notify and the logs."""
