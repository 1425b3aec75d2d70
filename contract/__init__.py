"""The contract between the API and the workers: settings, job records, queue and task names, event streams.

Nothing here imports torch or any model library, so the API can install without them.
"""
