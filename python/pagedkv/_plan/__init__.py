"""Planning attention work: the options and work split shared by decode and
prefill (work.py), what plan() prepares (plan.py), and one request's
contiguous K/V seen as a cache of one page (one_page.py)."""
