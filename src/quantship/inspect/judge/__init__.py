"""Judging a file for a target: the rules, the verdict of ``check_file``, a consumer's run
against its tolerance, and the three-way comparison a target is asked for.

The top of inspect's three jobs: it reads files (``read``) and runs them (``run``).
"""
