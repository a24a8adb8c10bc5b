"""The faults wing: what goes wrong in a run and how it is survived. Injected faults for drills
(`inject`), the hang watchdog, rollbacks on spikes and non-finite steps, and stragglers (`resilience`)."""
