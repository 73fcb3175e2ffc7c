/* The physical floor of an exec round trip: posix_spawn + waitpid of a program, in C.
 *
 * floor serve PROGRAM: for each line read on stdin, spawn PROGRAM once, wait for it and
 * print the nanoseconds it took; the harness drives it one request at a time so that the
 * floor is measured interleaved with the agent and its peers.
 * floor loop N PROGRAM: N spawns back to back, one line of nanoseconds each.
 */
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long long spawn_once(char *program) {
    char *argv[] = {program, NULL};
    pid_t pid;
    int status;
    long long start = now_ns();
    int err = posix_spawn(&pid, program, NULL, NULL, argv, environ);
    if (err != 0) {
        fprintf(stderr, "posix_spawn %s: %s\n", program, strerror(err));
        exit(1);
    }
    if (waitpid(pid, &status, 0) != pid) {
        perror("waitpid");
        exit(1);
    }
    return now_ns() - start;
}

int main(int argc, char **argv) {
    char line[64];
    if (argc == 3 && strcmp(argv[1], "serve") == 0) {
        setvbuf(stdout, NULL, _IOLBF, 0);
        while (fgets(line, sizeof line, stdin) != NULL)
            printf("%lld\n", spawn_once(argv[2]));
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "loop") == 0) {
        long n = atol(argv[2]);
        for (long i = 0; i < n; i++)
            printf("%lld\n", spawn_once(argv[3]));
        return 0;
    }
    fprintf(stderr, "usage: floor serve PROGRAM | floor loop N PROGRAM\n");
    return 2;
}
