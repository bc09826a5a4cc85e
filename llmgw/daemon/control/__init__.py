"""The control plane in rooms: plane/ (the plane itself), agents/ (the agents' sessions with it),
store/ (its store), lifecycle/ (model revisions and evals) and admin/ (the admin API's HTTP shell);
model_deploy.py (a model's deploy profile) is shared by the plane and the lifecycle."""
