"""The review page a team of reviewers uses to decide a run's review queues (``batch-inference review``)."""
