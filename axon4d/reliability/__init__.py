"""Failure handling (docs/reliability.md): bad input refused in one line, a failing job ended within
a deadline on every rank, and every rank reaching the same verdict.

    errors      how a command ends on bad input: which errors are refusals, the line, exit code 2
    diagnosis   a failing job's store keys, and who stopped found once, in O(world) requests
    watchdog    heartbeats, failure announcements and wait deadlines in the job's store (``guard``)
    agreement   every rank the same verdict on a step one rank alone may see fail: one all-gather

This package's ``__init__`` imports nothing: each module sits in its own layer of the contract in
``setup.cfg`` (errors and diagnosis are plain data, the watchdog beside the communication layer,
agreement above checkpoint files); import them by their full names.
"""
