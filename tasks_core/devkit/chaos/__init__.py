"""The fault campaign (`dtask chaos`): real workers, beat, Redis and PostgreSQL under a seeded fault
schedule, then a checker that counts violations of every invariant I1-I7 (README, "Invariants").

``faults`` builds the seeded schedule and controls the processes, ``campaign`` runs it, ``checker``
reads what PostgreSQL holds afterwards and ``cli`` is the command.
"""
