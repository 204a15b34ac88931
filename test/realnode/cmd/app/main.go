// Command app is the real node's test application (package podapp).
//
//	app serve [-listen :8080] [-hello URL] [-term-get URL] [-term-delay D]
//	app get [-wait D] [-timeout D] URL
//
// serve answers requests until SIGTERM; -hello makes one request at start
// (retried until it succeeds), -term-get one after SIGTERM (after
// -term-delay) before exiting. get makes one request and prints the body.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/test/realnode/podapp"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: app serve|get ...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "get":
		err = get(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q (serve, get)", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "app:", err)
		os.Exit(1)
	}
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	listen := fs.String("listen", ":8080", "listen address")
	hello := fs.String("hello", "", "GET this URL once at start")
	termGet := fs.String("term-get", "", "GET this URL after SIGTERM, before exiting")
	termDelay := fs.Duration("term-delay", 0, "wait this long after SIGTERM before -term-get")
	_ = fs.Parse(args)
	name := os.Getenv("POD_NAME")
	if name == "" {
		name, _ = os.Hostname()
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	s := &podapp.Server{Name: name}
	// Longer than the tests' own deadline for one request (trafficTimeout,
	// 10 s): a proxy that stalls is then judged by the client that waits
	// for it, as a timeout, not cut by this app as an early close that
	// looks like a dropped connection.
	srv := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 30 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }() // owner: serve; shut down below
	fmt.Println("app", name, "listening on", ln.Addr())
	if *hello != "" {
		hctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		body, err := podapp.Get(hctx, *hello)
		cancel()
		fmt.Printf("hello %s: %q %v\n", *hello, body, err)
	}
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	fmt.Println("SIGTERM")
	if *termGet != "" {
		time.Sleep(*termDelay)
		gctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		body, err := podapp.Get(gctx, *termGet)
		cancel()
		fmt.Printf("term-get %s: %q %v\n", *termGet, body, err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func get(args []string) error {
	fs := flag.NewFlagSet("get", flag.ExitOnError)
	wait := fs.Duration("wait", 0, "wait this long first")
	timeout := fs.Duration("timeout", 30*time.Second, "give up after this long")
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		return errors.New("usage: app get [-wait D] [-timeout D] URL")
	}
	time.Sleep(*wait)
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	body, err := podapp.Get(ctx, fs.Arg(0))
	if err != nil {
		return err
	}
	fmt.Print(body)
	return nil
}
