"""The controller's tools that prepare nodes before any job: first contact (bootstrap), the
training image's build and its shipment to the nodes. Runs on the controller only, never sent
to a node (cluster.sync.NODE_SIDE does not list this room)."""
