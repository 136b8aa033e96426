"""Cluster-scale goodput: a seeded discrete-event Monte Carlo fed with the costs our benchmarks measured.

``unbroken simulate-cluster`` projects what cannot be run here (thousands of
workers failing every few hours) from component costs measured here:
:mod:`~unbroken.cluster.costs` reads them from benchmark JSON files,
:mod:`~unbroken.cluster.scaling` scales them to a target model,
:mod:`~unbroken.cluster.failures` draws failures, :mod:`~unbroken.cluster.degraded`
gives the slowdown of a degraded step per takeover policy,
:mod:`~unbroken.cluster.strategies` plays each recovery strategy over the same
failures and :mod:`~unbroken.cluster.montecarlo` repeats it over seeds.
"""

from unbroken.cluster.costs import Figure, load_costs
from unbroken.cluster.failures import Event, FailureSpec, generate_events
from unbroken.cluster.montecarlo import SimOptions, run_monte_carlo
from unbroken.cluster.scaling import SimCosts, TargetHardware, scale_costs
from unbroken.cluster.strategies import Strategy, daly_interval_s, simulate_strategy, young_interval_s

__all__ = [
    "Event", "FailureSpec", "Figure", "SimCosts", "SimOptions", "Strategy", "TargetHardware",
    "daly_interval_s", "generate_events", "load_costs", "run_monte_carlo", "scale_costs", "simulate_strategy",
    "young_interval_s",
]
