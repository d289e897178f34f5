"""EBPO inside other engines: `integrations.trl` (a GRPOTrainer subclass) and
`integrations.verl` (an advantage-estimator plugin). Each imports its engine lazily, inside itself."""
