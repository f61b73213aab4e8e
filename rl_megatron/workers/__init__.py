"""Ray workers and their groups: one worker per device hosting its share of the roles, process-group setup,
offloading between phases."""
