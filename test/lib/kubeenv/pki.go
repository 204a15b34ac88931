package kubeenv

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"time"
)

// authority is the throwaway CA of one Env: it signs the apiserver's serving
// certificate and every client certificate (admin, or users tests ask for).
type authority struct {
	cert    *x509.Certificate
	key     crypto.Signer
	certPEM []byte
}

func newKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func serial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}

func newAuthority() (*authority, error) {
	key, err := newKey()
	if err != nil {
		return nil, fmt.Errorf("ca key: %w", err)
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: "kubeenv-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(7 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("self-sign ca: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &authority{cert: cert, key: key, certPEM: pemBlock("CERTIFICATE", der)}, nil
}

// issue signs a leaf certificate and returns it with its key, both PEM.
func (a *authority) issue(tmpl *x509.Certificate) (certPEM, keyPEM []byte, err error) {
	key, err := newKey()
	if err != nil {
		return nil, nil, fmt.Errorf("leaf key: %w", err)
	}
	if tmpl.SerialNumber, err = serial(); err != nil {
		return nil, nil, err
	}
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(7 * 24 * time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, a.cert, key.Public(), a.key)
	if err != nil {
		return nil, nil, fmt.Errorf("sign %s: %w", tmpl.Subject.CommonName, err)
	}
	keyPEM, err = privatePEM(key)
	if err != nil {
		return nil, nil, err
	}
	return pemBlock("CERTIFICATE", der), keyPEM, nil
}

// serving issues the apiserver's certificate for the loopback address, the
// in-cluster names and ips (the service IP, addresses it listens on), so
// clients verify it against the CA like in a cluster.
func (a *authority) serving(ips ...net.IP) (certPEM, keyPEM []byte, err error) {
	return a.issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses: append([]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, ips...),
	})
}

// client issues a client certificate: the apiserver takes the common name as
// the user name and the organizations as groups.
func (a *authority) client(user string, groups ...string) (certPEM, keyPEM []byte, err error) {
	return a.issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: user, Organization: groups},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

func privatePEM(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("marshal key: %w", err)
	}
	return pemBlock("PRIVATE KEY", der), nil
}

// serviceAccountKeys writes the key pair the apiserver signs and verifies
// ServiceAccount tokens with (what the TokenRequest API hands out).
func serviceAccountKeys(privPath, pubPath string) error {
	key, err := newKey()
	if err != nil {
		return fmt.Errorf("service account key: %w", err)
	}
	priv, err := privatePEM(key)
	if err != nil {
		return err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return fmt.Errorf("marshal service account public key: %w", err)
	}
	if err := os.WriteFile(privPath, priv, 0o600); err != nil {
		return err
	}
	return os.WriteFile(pubPath, pemBlock("PUBLIC KEY", pubDER), 0o600)
}
