"""The source: TrafficMaps and InferenceServices, from an API server or a directory of manifests.

Owns the newest object per key (the Stores), and says which keys changed to its `ChangeSink` (the
loop's dirty-key queue, which the loop owns). Fail static: only a list that succeeds replaces what a
Store holds. A TrafficMap event whose only change is other instances' conditions (other regions'
verdicts, with their managedFields) is recognised by a digest and only moves the Store's
resourceVersion; one whose only change is this instance's own condition is stored and
`reported`, not `changed` (no decision reads it; the status writer compares it).

The modules, importers name them (this package re-exports nothing):
- store: `Store` (with each object's revision), `MapStore` (maps indexed by the InferenceService each names), `Stores`, `ChangeSink`;
- objects: one raw object's resourceVersion, the digest of a TrafficMap, `parse_isvc`;
- watch: the watch protocol, free of I/O (`WatchState` turns a line into an event, bookmark or relist);
- refusals: answers retrying will not fix (`SourceRefused`, `describe_refusal`);
- informer: `Informer` (list then watch one resource in one namespace) and `WatchOptions`;
- informer_state: the Informer's bookkeeping as pure values (health, reconnects, listing, digests);
- kube_source: `KubeSource`, the informers of every namespace and when they are synced or stale;
- directory: `DirectorySource`, manifests in a directory;
- manifests, selector: reading manifest files, and the label-selector grammar.

May import: publisher.core, publisher.kube, publisher.retry, publisher.metrics and itself; never
the stages (gate, verify, plan), the loop or the command (import-linter's "edges-not-stages").
"""
