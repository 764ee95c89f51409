"""An offline install bundle for a machine without network: a GPU benchmark host or an air-gapped cluster."""
