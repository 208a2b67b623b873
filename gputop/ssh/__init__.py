"""The SSH transport: one kept connection per host, jump hosts, host keys and classified
errors; used by the sources, the jobs and the reservations store alike."""
