"""A small kubelet: runs the pods bound to node ``local`` as processes on this host.

The local cluster (``e2e/cluster.py``) has a real control plane but no kubelet; KWOK only
fakes the lifecycle of pods on the fake GPU nodes. The pod runner registers one more node,
``local``, and actually runs the pods the scheduler binds to it, so the demo and the
end-to-end tests can execute real programs (operator, trainer, explorers) as pods.

Usage::

    python -m e2e.podrunner --kubeconfig K [--node local] [--state-dir .local/podrunner]
    python -m e2e.podrunner logs <namespace>/<pod> [container] [-f] [--state-dir DIR]

    runner = PodRunner(kubeconfig, node="local", state_dir=...)
    runner.start()      # registers the node, starts background threads, returns
    runner.log_path("ns", "pod", "main")
    runner.stop()       # kills every pod's processes; pods stay as they are in the API

SIGTERM/SIGINT stop the CLI the same way. The runner acts with the credentials of the
kubeconfig it is given, normally the cluster's admin kubeconfig: like a kubelet it needs
broad rights (read every Secret and ConfigMap its pods use, mint ServiceAccount tokens,
write node and pod status, delete pods), and it does not restrict itself to what the
Node authorizer would allow a real kubelet.

Node
    ``local`` is registered (if absent) with labels ``kubernetes.io/hostname=local``,
    ``rft.dev/local-node=true``, ``kubernetes.io/os=linux`` and the taint
    ``rft.dev/local=true:NoSchedule``, so only pods that tolerate it (and normally select
    ``rft.dev/local-node: "true"``) land here. It has no KWOK annotation, so KWOK leaves it
    alone. Its Lease in ``kube-node-lease`` is renewed every 10 s and its Ready condition
    every 20 s, so the node-lifecycle controller keeps it Ready while the runner lives.
    Capacity: this host's CPUs and memory, 110 pods, ``nvidia.com/gpu: 0``.

Pods (what each pod gets)
    * A loopback IP ``127.0.0.X`` (X in 2..254, unique among live pods). There is no
      network namespace: the whole 127/8 block routes to ``lo`` on Linux, so a process
      can bind its pod IP and others can dial it. Ports are shared with the host.
    * Mount and UTS namespaces. Every container process is started as
      ``unshare --mount --uts --propagation private -- /bin/sh -c <setup> ...``: the setup
      bind-mounts each volume at its real ``mountPath`` (``readOnly`` remounts it read-only),
      bind-mounts the pod's hosts file onto ``/etc/hosts``, sets the hostname to
      ``spec.hostname`` (or the pod name), changes to the working directory and execs the
      command. Programs therefore see exactly the paths a kubelet would give them
      (``/var/run/secrets/kubernetes.io/serviceaccount/token``, ``/etc/rft/config.json``,
      ``/dev/shm``), and the unmodified in-cluster Kubernetes client works. The rest of the
      filesystem is the host's: this repository's Python environment is "the image".
      Chosen over LD_PRELOAD tricks (nss_wrapper for names, path rewriting for files)
      because those only cover what they intercept: a static binary, a direct syscall or
      a Python ``open()`` of a hard-coded path would escape them, while a bind mount is
      seen by everything. The price: it needs root (CAP_SYS_ADMIN) for ``unshare(2)``
      and ``mount(2)``; ``start()`` checks this and fails with a clear error otherwise.
      Missing mount points are created (empty) on the host filesystem and left there;
      the mounts themselves exist only inside each container's mount namespace.
    * DNS through ``/etc/hosts`` (no DNS server): the runner writes each pod's hosts file
      in place (same inode, so the bind mount sees updates) whenever pods or Services
      change. Entries: ``localhost``; the pod's own IP with its FQDN and hostname; for
      each live pod with ``spec.hostname`` and ``spec.subdomain``
      ``<host>.<subdomain>.<ns>.svc.cluster.local``, ``...svc`` and ``<host>.<subdomain>.<ns>``;
      for each headless Service with a selector ``<svc>.<ns>.svc.cluster.local``,
      ``<svc>.<ns>.svc`` and ``<svc>.<ns>`` for each ready pod (on this node) it selects.
      Pods in the same namespace also get the short forms ``<host>.<subdomain>`` and
      ``<svc>`` (what the resolv.conf search path would give); ``hostAliases`` are added.
      ClusterIP Services are not resolvable (there is no kube-proxy).
    * Environment: the runner's own environment minus ``KUBECONFIG``, ``AWS_*`` and
      ``KUBERNETES_*``, plus ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` (the
      API server's real address from the kubeconfig; its serving certificate covers it),
      ``HOSTNAME``, then the container's ``envFrom`` and ``env`` (``value``, ``fieldRef``,
      ``resourceFieldRef``, ``secretKeyRef``, ``configMapKeyRef``, with ``optional``), with
      Kubernetes ``$(VAR)`` expansion (``$$`` escapes) in env values, command and args. A
      missing required Secret/ConfigMap/key leaves the container waiting with reason
      ``CreateContainerConfigError`` and is retried. ``command[0]`` ``python``/``python3``
      means ``sys.executable``. No Service link variables.
    * Volumes under ``<state>/pods/<ns>_<name>_<uid>/volumes/<vol>``: emptyDir (medium
      Memory lives under /dev/shm), hostPath, configMap, secret, downwardAPI and projected
      (serviceAccountToken from the TokenRequest API, bound to the pod, refreshed at 80%
      of its lifetime; configMap; secret; downwardAPI), with ``items``, ``optional``,
      ``defaultMode``/``mode`` and ``subPath``. The API server's automatic
      ``kube-api-access-*`` volume therefore works. ConfigMap/Secret contents are read
      when the pod starts and not refreshed afterwards. A volume that cannot be set up
      yet (e.g. a Secret not created yet) keeps the pod ContainerCreating and is retried;
      unsupported volume types (PVCs, ...) keep it there for good.
    * Containers: init containers in order (each must exit 0; a failure restarts it with
      back-off, or fails the pod under restartPolicy Never), then all containers at once,
      each in its own process group (``containerID: runner://<pid>``), stdout+stderr
      appended to ``<pod dir>/<container>.log``. restartPolicy Always/OnFailure/Never with
      crash back-off 1 s doubling to 30 s. Sidecar init containers (``restartPolicy:
      Always`` on an init container) are not supported: they run like ordinary init
      containers, so one that never exits keeps the pod initialising.
    * readinessProbe: httpGet (host defaults to the pod IP, numeric or named port),
      tcpSocket and exec (run with ``nsenter`` inside the container's namespaces), with
      initialDelaySeconds, periodSeconds, timeoutSeconds, successThreshold and
      failureThreshold. Without one a container is ready while it runs. Liveness and
      startup probes, lifecycle hooks, resource limits, securityContext (users,
      capabilities), termination messages and image pulls are ignored.
    * Status is patched (only on change) like a kubelet: phase, podIP(s), hostIP(s),
      startTime, conditions, (init)containerStatuses with state/lastState/restartCount.
    * Deletion: on a deletionTimestamp every container's process group gets SIGTERM, then
      SIGKILL after the grace period; the pod's directory and IP are released and the pod
      object is deleted with gracePeriodSeconds=0 (the kubelet's final delete). A pod
      deleted outright gets its processes killed. When the runner starts, pods on its
      node that it did not start (their processes died with a previous runner) and that
      are not finished are marked Failed with reason ``NodeRestart`` (exit code 137).
    * Logs: ``python -m e2e.podrunner logs ns/pod [container]`` prints
      ``<state>/pods/<ns>_<pod>_<uid>/<container>.log``. ``kubectl logs`` works too: the
      runner serves the kubelet's ``/containerLogs/{ns}/{pod}/{container}`` (``tailLines``,
      ``follow``, ``limitBytes``) over HTTPS with a self-signed certificate on the node's
      InternalIP and kubelet port (the API server does not verify kubelet certificates
      when no kubelet CA is configured). The endpoint does not authenticate callers; it
      only serves pod logs.

The runner's own log is ``<state>/podrunner.log`` (and stderr). If the runner dies
without stopping (SIGKILL), its pods' processes keep running; stop them by hand.

Layout (this package)
    ``runner.py`` ``PodRunner``: start/stop, the pod and Service watches, pod IPs;
    ``node.py`` node registration, status heartbeats and the Lease;
    ``worker.py`` one thread per pod (its lifecycle and phase), built from
    ``process.py`` (the unshare/mount wrapper, container processes, restarts, kills),
    ``env.py`` (env, fieldRef/resourceFieldRef, Secret/ConfigMap reads, ``$(VAR)``),
    ``volumes.py`` (volumes, projected ServiceAccount tokens), ``probes.py`` (readiness)
    and ``status.py`` (pod status patches); ``dns.py`` the hosts files;
    ``logserver.py`` container log files and the kubelet log endpoint; ``api.py`` the API
    client; ``common.py`` the logger, defaults, errors and helpers; ``__main__.py`` the CLI.
"""

from .common import DEFAULT_NODE, DEFAULT_STATE_DIR, PodRunnerError
from .runner import PodRunner

__all__ = ["DEFAULT_NODE", "DEFAULT_STATE_DIR", "PodRunner", "PodRunnerError"]
