// pause holds a pod's namespaces open, as the sandbox container of every pod on the e2e node.
// The usual pause image cannot be pulled here, so the node builds this one (e2e/cluster/build.sh).
// It sleeps until SIGTERM or SIGINT and, as PID 1 of the pod's PID namespace when that namespace
// is shared, reaps orphaned children so they do not pile up as zombies.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	children := make(chan os.Signal, 16)
	signal.Notify(children, syscall.SIGCHLD)
	for {
		select {
		case <-stop:
			os.Exit(0)
		case <-children:
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
