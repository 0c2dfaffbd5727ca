#!/bin/bash
printf 'Hello, Polar!' > /app/greeting.txt
