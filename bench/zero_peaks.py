"""bench/zero.sh's reading of summary.json's peak_rss_bytes_by_phase (one list per phase, a
value per worker in job order: the first site's WORKERS ranks, then the second site's)."""


def largest(peaks, phase, workers0, gateway):
    """The largest peak in `phase` among the gateways (each site's rank 0: job index 0 and
    workers0) or among the other workers; 0 when there are none."""
    values = peaks[phase]
    gateways = {0, workers0} if len(values) > workers0 else {0}
    picked = [v for i, v in enumerate(values) if (i in gateways) == gateway]
    return max(picked, default=0)


def job_sum(peaks):
    """The sum over the workers of each one's peak over every phase: what the job needs at most."""
    phases = [p for p, v in peaks.items() if isinstance(v, list)]
    return sum(max(peaks[p][i] for p in phases) for i in range(len(peaks[phases[0]])))
