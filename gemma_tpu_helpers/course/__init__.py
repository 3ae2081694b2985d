"""The course on top of the fixes: profiles, run directories, downloads, the tiny replica, caching, training runs,
plans, benchmarks, cost, preflight, the site, the workshop, the exercises and the CLI's steps."""
