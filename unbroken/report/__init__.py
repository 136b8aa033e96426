"""unbroken.report: ``unbroken report RUN``, what a run did, read from its event log.

- :mod:`~unbroken.report.run_report`: the command (tables and JSON);
- :mod:`~unbroken.report.recovery_phases`: each recovery cut into its phases;
- :mod:`~unbroken.report.series`: the per-step series the plot draws;
- :mod:`~unbroken.report.plot`: the figure (matplotlib).
"""
