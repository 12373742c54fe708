"""The README's second story, on the embedded default after the main command: the drafter it trained serving as
production, traffic of a kind it never saw, drift, a challenger retrained on the traffic, the gate, the rollout
(serving_loop.py, `eagle3-assets serving-loop`); with the pieces a team has and the story stands in for: a
gateway writing its request log (gateway.py) and a server run under a service manager
(eagle3_assets/worker/serving/prod_server.py, on the serving machine)."""
